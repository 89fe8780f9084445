"""Eviction policies against LRU and the optimum, on the Mooncake trace and generated families.

Prints, in one run:

1. the goal tables: block hit rate (%) of every policy and of Belady's MIN at 1,000 to
   20,000 blocks on the Mooncake trace, on each ``synth-trace`` family and on the multi-turn
   families with Pareto-tailed conversations (``-pareto``: the longer one has run, the likelier
   it goes on, as in public chat logs), a ``!`` beside any cell below LRU, and the share of
   the LRU-to-optimum gap each policy closes at 5,000 blocks and where LRU comes nearest a
   third of the optimum (issue 26's goal capacity);
2. what each signal buys: ``signals`` (and ``slru``) with one signal taken away;
   Beside each, the share an LRU that knows which blocks are dead would close
   (``dead_block_oracle.py``): what is left to a past-only policy;
3. the allocator benchmark's ratio (``benchmarks/allocator.py``) with each policy, and
   ``learned``'s cost over LRU's (goal <= 2x).

Each replay is single-threaded and deterministic; the full run takes about ten minutes
on this machine (``--quick``: three capacities, no ablation, about three).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

from prefixcache import KVCacheManager
from prefixcache.cache import policies
from prefixcache.cache.policies import POLICY_NAMES
from prefixcache.sim.belady import belady_hits
from prefixcache.sim.replay import block_references, replay
from prefixcache.sim.synth import FAMILIES, MULTI_TURN_FAMILIES, family_config, synth_trace
from prefixcache.sim.traces import Trace, load_trace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import allocator  # the allocator benchmark's workload and reference
from dead_block_oracle import oracle_hit_rate

TRACE = Path(__file__).resolve().parents[1] / "data/mooncake_synthetic_trace.jsonl"
CAPACITIES = [1000, 2000, 5000, 10000, 15000, 20000]
QUICK_CAPACITIES = [1000, 5000, 20000]
GOAL_CAPACITY = 5000
ABLATION_CAPACITIES = [1000, 5000, 20000]


def traces(mooncake: Path) -> list[tuple[str, Trace]]:
    """The Mooncake trace, one trace per generated family (seed 0, Mooncake format), and
    the multi-turn families again with Pareto-tailed conversation lengths."""
    found = [("mooncake", load_trace(mooncake))]
    found += [(name, synth_trace(family_config(name), name=name)) for name in FAMILIES]
    for name in MULTI_TURN_FAMILIES:
        config = dataclasses.replace(family_config(name), turn_tail="pareto")
        found.append((f"{name}-pareto", synth_trace(config, name=f"{name}-pareto")))
    return found


def goal_table(name: str, trace: Trace, capacities: list[int]) -> tuple[list[str], list]:
    """The hit-rate table of one trace, and its cells below LRU."""
    references = block_references(trace, 0)
    total = sum(len(ids) for ids in references)
    rows = [f"{name}: {len(trace.requests):,} requests, {total:,} block references"]
    rows.append(f"  {'capacity':>8} " + " ".join(f"{p:>8}" for p in POLICY_NAMES) + "  optimum")
    below, gaps, lru_share, rates_at = [], {}, {}, {}
    for capacity in capacities:
        rates = {p: replay(trace, capacity, p).block_hit_rate for p in POLICY_NAMES}
        optimum = belady_hits(block_references(trace, capacity), capacity) / total
        cells = []
        for policy, rate in rates.items():
            low = round(100 * rate, 2) < round(100 * rates["lru"], 2)
            below += [(name, capacity, policy)] if low else []
            cells.append(f"{100 * rate:>7.2f}{'!' if low else ' '}")
        rows.append(f"  {capacity:>8} " + " ".join(cells) + f" {100 * optimum:>7.2f}")
        gaps[capacity] = {p: _closed(r, rates["lru"], optimum) for p, r in rates.items()}
        lru_share[capacity] = rates["lru"] / optimum if optimum else 1.0
        rates_at[capacity] = (rates["lru"], optimum)
    third = min(lru_share, key=lambda c: abs(lru_share[c] - 1 / 3))
    for capacity in dict.fromkeys(c for c in (GOAL_CAPACITY, third) if c in gaps):
        closed = ", ".join(f"{p} {100 * g:.0f}%" for p, g in gaps[capacity].items())
        why = f" (lru at {lru_share[capacity]:.2f} of the optimum)"
        rows.append(f"  gap to the optimum closed at {capacity:,}{why}: {closed}")
        if trace.kind == "mooncake":
            lru, optimum = rates_at[capacity]
            oracle = _closed(oracle_hit_rate(trace, capacity), lru, optimum)
            rows.append(f"    (LRU that knows which blocks are dead: {100 * oracle:.0f}%)")
    return rows, below


def _closed(rate: float, lru: float, optimum: float) -> float:
    return (rate - lru) / (optimum - lru) if optimum > lru else 0.0


def ablation_variants() -> dict[str, type]:
    """``signals`` and ``slru`` without each signal, registered under their own names."""
    variants = {}
    for base in (policies.SignalsPolicy, policies.SLRUPolicy):
        for label, attributes in (
            ("", {}),
            ("-seen", {"features": frozenset({"last"})}),
            ("-last", {"features": frozenset({"seen"})}),
            ("-leaf", {"leaf_first": False}),
            ("+depth", {"features": policies.ALL_SIGNALS}),
        ):
            name = f"{base.name}{label}"
            variants[name] = type(name, (base,), {"name": name, **attributes})
    policies.POLICIES.update(variants)
    return variants


def ablation_table(named_traces: list[tuple[str, Trace]]) -> list[str]:
    """Gap closed (%) at each ablation capacity, per variant and trace."""
    variants = list(ablation_variants())
    rows = ["what each signal buys: share of the LRU-to-optimum gap closed (%), "
            f"at {', '.join(f'{c:,}' for c in ABLATION_CAPACITIES)} blocks"]  # fmt: skip
    rows.append(f"  {'variant':<14}" + "".join(f"{name:>18}" for name, _ in named_traces))
    closed: dict[str, list[str]] = {variant: [] for variant in variants}
    for _, trace in named_traces:
        references = block_references(trace, 0)
        total = sum(len(ids) for ids in references)
        per_capacity = {v: [] for v in variants}
        for capacity in ABLATION_CAPACITIES:
            lru = replay(trace, capacity, "lru").block_hit_rate
            optimum = belady_hits(block_references(trace, capacity), capacity) / total
            for variant in variants:
                rate = replay(trace, capacity, variant).block_hit_rate
                per_capacity[variant].append(f"{100 * _closed(rate, lru, optimum):.0f}")
        for variant in variants:
            closed[variant].append("/".join(per_capacity[variant]))
    for variant in variants:
        rows.append(f"  {variant:<14}" + "".join(f"{cell:>18}" for cell in closed[variant]))
    return rows


def allocator_ratios(rounds: int) -> list[str]:
    """The allocator benchmark's ours/sha256 ratio (median of rounds) with each policy."""
    prompts = allocator.make_prompts(200)
    rows = ["allocator benchmark (benchmarks/allocator.py workload), ratio ours/sha256 chain:"]
    medians = {}
    for policy in POLICY_NAMES:
        ratios = []
        for _ in range(rounds):
            ours, reference = _allocator_round(prompts, policy)
            ratios.append(ours / reference)
        medians[policy] = statistics.median(ratios)
        rows.append(f"  {policy:<8} {medians[policy]:.2f}")
    cost = medians["learned"] / medians["lru"]
    rows.append(f"  learned/lru {cost:.2f} (goal <= 2.0)")
    return rows


def _allocator_round(prompts: list[list[int]], policy: str) -> tuple[float, float]:
    """One round of ``allocator.measure_round``, with ``policy`` (alternating per request)."""
    manager = KVCacheManager(
        num_blocks=1024, block_size=allocator.BLOCK_SIZE, eviction_policy=policy
    )
    clock, ours, reference = time.perf_counter, 0.0, 0.0
    for index, prompt in enumerate(prompts):
        start = clock()
        allocator.request_cycle(manager, f"r{index}", prompt)
        middle = clock()
        allocator.sha256_chain(prompt)
        reference += clock() - middle
        ours += middle - start
    manager.check_invariants()
    return ours, reference


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--quick", action="store_true", help="three capacities, no ablation")
    parser.add_argument("--allocator-rounds", type=int, default=7)
    args = parser.parse_args()
    named = traces(args.trace)
    capacities = QUICK_CAPACITIES if args.quick else CAPACITIES
    below = []
    for name, trace in named:
        rows, low = goal_table(name, trace, capacities)
        print("\n".join(rows), flush=True)
        below += low
    print("cells below LRU: " + (", ".join(f"{n} {c:,} {p}" for n, c, p in below) or "none"))
    families = ", ".join(MULTI_TURN_FAMILIES)
    goal = "goal: >= 25% of the gap where lru is nearest a third of the optimum"
    print(f"multi-turn families ({goal}): {families}")
    if not args.quick:
        print("\n".join(ablation_table(named[: 1 + len(FAMILIES)])), flush=True)
    print("\n".join(allocator_ratios(args.allocator_rounds)))


if __name__ == "__main__":
    main()
