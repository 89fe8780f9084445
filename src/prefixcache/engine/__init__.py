"""The serving engine: a Llama-family model on paged KV blocks, with continuous batching."""
