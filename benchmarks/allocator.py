"""Allocator cost per request vs a bare SHA-256 chain over the same prompt blocks.

Workload (issue 2): 200 requests, each a shared 4,000-token prefix + 96 unique tokens,
block size 16; each is admitted, prefilled (commit), decodes 32 tokens (append + commit
per step), then is freed. The reference is what every peer pays before any allocator
work: the prompt's token ids to bytes, then hashlib.sha256 chained over its full blocks.
Both are timed in alternating rounds of the same run; the ratio of medians is printed.

Variants (issues 11 and 20): the same cycle with an owner given but fairness off, through a
fair pool with one owner, through a fair pool with two owners (each with its own salt, so
two prefixes are cached), with an eviction policy object (ARC), and with KV events reported,
interleaved per request with the plain run; each one's time over the plain run's is printed
(median of rounds). One owner must cost nothing measurable.
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


VARIANTS = [  # (name, manager options, admit options of request i)
    ("no owners", {}, lambda i: {}),
    ("owner given, fairness off", {}, lambda i: {"owner": "acme"}),
    ("fair pool, one owner", {"owner_shares": {}}, lambda i: {"owner": "acme"}),
    (
        "fair pool, two owners",
        {"owner_shares": {}},
        lambda i: {"owner": "ab"[i % 2], "cache_salt": "ab"[i % 2]},
    ),
    ("eviction policy arc", {"eviction_policy": "arc"}, lambda i: {}),
    ("KV events reported", {"events": True}, lambda i: {}),
]


def make_manager(options: dict) -> KVCacheManager:
    """A manager for one variant; ``events`` sets a sink that keeps the events."""
    options = dict(options)
    events = options.pop("events", False)
    manager = KVCacheManager(num_blocks=1024, block_size=BLOCK_SIZE, **options)
    if events:
        manager.set_event_sink([].append)
    return manager


def request_cycle(
    manager: KVCacheManager, request_id: str, prompt: list[int], **admit: object
) -> int:
    """Admit, prefill (commit), decode (append + commit per step), free; cached tokens."""
    seq = manager.admit(request_id, prompt, **admit)
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


def measure_round(prompts: list[list[int]]) -> tuple[float, float, int, list[float]]:
    """One round, ours, the reference and the owner variants alternating per request:
    (ours s, ref s, hits, seconds of each owner variant; the first is ours again).

    Alternating per request keeps them all under the same machine conditions.
    """
    managers = [make_manager(options) for _, options, _ in VARIANTS]
    clock = time.perf_counter
    variants = [0.0] * len(managers)
    reference = 0.0
    cached = 0
    for index, prompt in enumerate(prompts):
        for turn in range(len(managers)):
            which = (index + turn) % len(managers)  # rotate who goes first
            admit = VARIANTS[which][2](index)
            start = clock()
            hits = request_cycle(managers[which], f"r{index}", prompt, **admit)
            variants[which] += clock() - start
            cached += hits if which == 0 else 0
        middle = clock()
        sha256_chain(prompt)
        reference += clock() - middle
    for manager in managers:
        manager.check_invariants()
        assert manager.num_free_blocks == manager.num_blocks
    return variants[0], reference, cached, variants


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    prompts = make_prompts(args.requests)
    rounds = [measure_round(prompts) for _ in range(args.rounds)]
    ratio = statistics.median(ours / reference for ours, reference, _, _ in rounds)
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
    print("  variants, time over the plain run (median of rounds; goal for one owner: 1.00):")
    for number, (name, _, _) in enumerate(VARIANTS[1:], start=1):
        owner_ratio = statistics.median(r[3][number] / r[3][0] for r in rounds)
        print(f"    {name:<28} {owner_ratio:.3f}")


if __name__ == "__main__":
    main()
