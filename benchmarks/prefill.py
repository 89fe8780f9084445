"""Prefill on int4 weights against the exact fp32 path (`--dequantize`), in one run (issue 27).

The int4 model runs a chunk of more than 48 rows on a dense fp32 matmul over `W'` (the int4
kernel's own dequantization, quant.py), so prefill-bound work should cost what the fp32
path costs; the goal is int4 no slower (speed ratio >= 1.0). Two workloads, each prompt new
to the cache: one 2,000-token prompt (1 token out), and 16 prompts of 565 tokens sent at
once (1 token out each). The engines alternate (int4, fp32, fp32, int4, ...) for 3 rounds
each; medians.
"""

from __future__ import annotations

import os
import random
import statistics
import time

import torch

from prefixcache import LLM, SamplingParams

ROUNDS = 3


def prompts(rng: random.Random, count: int, length: int) -> list[list[int]]:
    return [[rng.randrange(1000, 40000) for _ in range(length)] for _ in range(count)]


def seconds(llm: LLM, batch: list[list[int]]) -> float:
    """Wall time to prefill `batch` at once (1 token out each), from an empty cache."""
    llm.engine.manager.reset()
    params = SamplingParams(max_tokens=1, temperature=0.0)
    started = time.perf_counter()
    llm.generate(batch, params)
    return time.perf_counter() - started


def main() -> None:
    engines = {
        "int4": LLM(enable_prefix_caching=False),
        "fp32": LLM(enable_prefix_caching=False, quantized_weights=False),
    }
    rng = random.Random(7)
    workloads = {
        "one 2,000-token prompt": prompts(rng, 1, 2000),
        "16 x 565 tokens at once": prompts(rng, 16, 565),
    }
    print(f"prefill, default model, {torch.get_num_threads()} threads, {ROUNDS} rounds, medians")
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    for name, batch in workloads.items():
        for llm in engines.values():
            seconds(llm, batch[:1])  # warm-up
        times: dict[str, list[float]] = {tag: [] for tag in engines}
        for round_ in range(ROUNDS):
            order = list(engines) if round_ % 2 == 0 else list(reversed(engines))
            for tag in order:
                times[tag].append(seconds(engines[tag], batch))
        int4, fp32 = (statistics.median(times[tag]) for tag in ("int4", "fp32"))
        tokens = sum(len(p) for p in batch)
        print(
            f"  {name:<24} int4 {int4:6.2f}s ({tokens / int4:5.0f} tok/s)   fp32 {fp32:6.2f}s "
            f"({tokens / fp32:5.0f} tok/s)   int4 speed {fp32 / int4:.2f}x (goal >= 1.0)"
        )
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
