"""The OpenAI-compatible HTTP server: tenants, streaming, Prometheus metrics."""
