"""KV dtypes (issue 35): bytes a token and decode speed of each `--kv-cache-dtype`, one run.

The default model, as `serve` builds it (fp32 on the int4 kernels, the fused decode), or
`--model` (Gemma 3 270M: `--model gemma3-270m`, the eager path, its `--kv-layout`). For
each dtype: the pool's bytes a token and the tokens 2 GiB hold; decode tok/s of one
sequence and of 8 at once after a `--prompt-tokens` prompt (512; 128 tokens out, greedy,
best of three);
each as a ratio to float32. The issue's goal: bfloat16 and int8 no slower than float32.
`benchmarks/peers.py` has llama-server's numbers for the same file (its default f16 KV).
"""

from __future__ import annotations

import argparse
import time

import torch

from prefixcache.engine.cache_folder import default_cache_dir
from prefixcache.engine.engine import EngineConfig, LLMEngine
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.engine.weight_cache import load_serving_model

DTYPES = ("float32", "bfloat16", "int8")
OUT_TOKENS = 128


def decode_rate(engine: LLMEngine, prompt: list[int], rows: int) -> float:
    """Generated tokens a second after the first token, over ``rows`` sequences at once."""
    params = SamplingParams(temperature=0, max_tokens=OUT_TOKENS, ignore_eos=True)
    engine.manager.reset()
    for row in range(rows):
        engine.add_request(f"r{row}", [row + 1, *prompt], params)  # distinct: no sharing
    first, started = None, set()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.outputs[0].token_ids:
                started.add(output.request_id)
        if first is None and len(started) == rows:  # every prompt in: decode from here
            first = time.perf_counter()
    assert first is not None
    return rows * (OUT_TOKENS - 1) / (time.perf_counter() - first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", help="name or GGUF (default: the default model)")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--kv-layout", default="hybrid", choices=("hybrid", "full"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_serving_model(args.model, default_cache_dir())
    prompt = list(range(1000, 1000 + args.prompt_tokens))
    blocks = 8 * (args.prompt_tokens + OUT_TOKENS) // 16 + 64
    print(
        f"KV dtypes on {loaded.source.name}, {args.threads} threads, {args.prompt_tokens}-token "
        f"prompts, --kv-layout {args.kv_layout}"
    )
    print(f"{'dtype':10} {'bytes/token':>12} {'tokens in 2 GiB':>16} "
          f"{'decode 1 tok/s':>15} {'decode 8 tok/s':>15}")  # fmt: skip
    base: dict[str, float] = {}
    for name in DTYPES:
        config = EngineConfig(kv_cache_dtype=name, num_kv_blocks=blocks, kv_layout=args.kv_layout)
        engine = LLMEngine(loaded, config)
        per_token = engine.kv_store.bytes_per_token
        rates = {
            rows: max(decode_rate(engine, prompt, rows) for _ in range(args.repeats))
            for rows in (1, 8)
        }
        base = base or rates
        print(
            f"{name:10} {per_token:>12,} {2**31 // per_token:>16,} "
            f"{rates[1]:>9.1f} {rates[1] / base[1]:.2f}x {rates[8]:>9.1f} {rates[8] / base[8]:.2f}x"
        )


if __name__ == "__main__":
    main()
