"""Allocator cost per request vs a bare SHA-256 chain over the same prompt blocks.

Workload (issue 2): 200 requests, each a shared 4,000-token prefix + 96 unique tokens,
block size 16; each is admitted, prefilled (commit), decodes 32 tokens (append + commit
per step), then is freed. The reference is what every peer pays before any allocator
work: the prompt's token ids to bytes, then hashlib.sha256 chained over its full blocks.
Both are timed in alternating rounds of the same run; the ratio of medians is printed.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import struct
import time

from prefixcache import KVCacheManager

BLOCK_SIZE = 16
PREFIX_TOKENS = 4000
UNIQUE_TOKENS = 96
DECODE_STEPS = 32
VOCAB = 49152


def make_prompts(num_requests: int, seed: int = 0) -> list[list[int]]:
    """One shared prefix, a unique suffix per request."""
    rng = random.Random(seed)
    prefix = [rng.randrange(VOCAB) for _ in range(PREFIX_TOKENS)]
    return [
        prefix + [rng.randrange(VOCAB) for _ in range(UNIQUE_TOKENS)] for _ in range(num_requests)
    ]


def request_cycle(manager: KVCacheManager, request_id: str, prompt: list[int]) -> int:
    """Admit, prefill (commit), decode (append + commit per step), free; cached tokens."""
    seq = manager.admit(request_id, prompt)
    manager.commit(seq, len(prompt))
    for step in range(DECODE_STEPS):
        manager.append(seq, [step])
        manager.commit(seq, len(seq.token_ids))
    manager.free(seq)
    return seq.num_cached_tokens


def sha256_chain(prompt: list[int]) -> bytes:
    """The reference: token ids to bytes, then SHA-256 chained over full blocks."""
    step = BLOCK_SIZE * 4
    data = struct.pack(f"<{len(prompt)}I", *prompt)
    digest = b""
    for start in range(0, len(data) - step + 1, step):
        digest = hashlib.sha256(digest + data[start : start + step]).digest()
    return digest


def measure_round(prompts: list[list[int]]) -> tuple[float, float, int]:
    """One round, ours and the reference alternating per request: (ours s, ref s, hits).

    Alternating per request keeps the two under the same machine conditions.
    """
    manager = KVCacheManager(num_blocks=1024, block_size=BLOCK_SIZE)
    clock = time.perf_counter
    ours = reference = 0.0
    cached = 0
    for index, prompt in enumerate(prompts):
        start = clock()
        cached += request_cycle(manager, f"r{index}", prompt)
        middle = clock()
        sha256_chain(prompt)
        reference += clock() - middle
        ours += middle - start
    manager.check_invariants()
    assert manager.num_free_blocks == manager.num_blocks
    return ours, reference, cached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    prompts = make_prompts(args.requests)
    rounds = [measure_round(prompts) for _ in range(args.rounds)]
    ratio = statistics.median(ours / reference for ours, reference, _ in rounds)
    per_request = 1e6 / args.requests
    ours_us = statistics.median(r[0] for r in rounds) * per_request
    reference_us = statistics.median(r[1] for r in rounds) * per_request
    hit_share = rounds[0][2] / sum(len(p) for p in prompts)
    print(
        f"allocator: {args.requests} requests x ({PREFIX_TOKENS} shared + {UNIQUE_TOKENS} "
        f"unique tokens), block {BLOCK_SIZE}, {DECODE_STEPS} decode steps, "
        f"{args.rounds} rounds; prompt tokens served from cache {hit_share:.1%}"
    )
    print(f"  prefixcache admit+commit+decode+free: {ours_us:8.1f} us/request")
    print(f"  bare sha256 chain over prompt blocks: {reference_us:8.1f} us/request")
    print(f"  ratio ours/sha256 chain (median of rounds): {ratio:.2f} (goal <= 1.0)")


if __name__ == "__main__":
    main()
