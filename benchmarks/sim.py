"""Trace replay speed: every eviction policy on both prefix indexes, and radix/hash.

Replays the Mooncake synthetic trace (3,993 requests, 121,877 block references) through
``KVCacheManager`` at 5,000 blocks, once per policy and index per round; hash and radix
alternate within each round (this machine is shared and noisy) and the wall times are
medians over the rounds. Both indexes must serve identical hits.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from prefixcache.cache.index import INDEX_NAMES
from prefixcache.cache.policies import POLICY_NAMES
from prefixcache.sim.replay import replay
from prefixcache.sim.traces import load_trace

TRACE = Path(__file__).resolve().parents[1] / "data/mooncake_synthetic_trace.jsonl"


def measure(trace_path: Path, capacity: int, rounds: int) -> dict[tuple[str, str], list]:
    """(policy, index) -> [wall seconds per round..., hit rate, hits per request]."""
    trace = load_trace(trace_path)
    results: dict[tuple[str, str], list] = {}
    for round_number in range(rounds):
        for policy in POLICY_NAMES:
            order = INDEX_NAMES if round_number % 2 == 0 else INDEX_NAMES[::-1]
            for index in order:
                run = replay(trace, capacity, policy, index)
                entry = results.setdefault((policy, index), [[], 0.0, None])
                entry[0].append(run.wall_seconds)
                entry[1], entry[2] = run.block_hit_rate, run.hits_per_request
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--capacity", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    results = measure(args.trace, args.capacity, args.rounds)
    print(
        f"sim: {args.trace.name} at {args.capacity} blocks, median of {args.rounds} rounds"
        " (replay wall time through KVCacheManager)"
    )
    print(f"  {'policy':<8}{'hit rate':>10}{'hash':>10}{'radix':>10}{'radix/hash':>12}")
    ratios = []
    for policy in POLICY_NAMES:
        hashed, radix = results[(policy, "hash")], results[(policy, "radix")]
        assert hashed[2] == radix[2], f"{policy}: the indexes served different hits"
        hash_s, radix_s = statistics.median(hashed[0]), statistics.median(radix[0])
        ratios.append(radix_s / hash_s)
        print(
            f"  {policy:<8}{100 * hashed[1]:>9.2f}%{hash_s:>9.2f}s{radix_s:>9.2f}s"
            f"{radix_s / hash_s:>12.2f}"
        )
    print(f"  radix/hash over all policies (median): {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
