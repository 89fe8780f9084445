"""A sweep: every capacity x policy x index replayed, and the optimum at each capacity; and
a retention sweep: every capacity x TTL x budget, beside no retention."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prefixcache.cache.common import DEFAULT_BLOCK_SIZE
from prefixcache.sim.belady import belady_hits, infinite_hits
from prefixcache.sim.kv_model import KVModel
from prefixcache.sim.replay import (
    Progress,
    ReplayResult,
    RetentionModel,
    block_references,
    block_tokens,
    replay,
)
from prefixcache.sim.traces import Trace


@dataclass(slots=True)
class Optimum:
    """Belady's MIN at one capacity, in blocks (see ``belady``)."""

    capacity: int
    hit_blocks: int
    block_hit_rate: float
    wall_seconds: float


@dataclass(slots=True)
class SweepReport:
    """All results of one sweep, plus a summary of the trace."""

    trace: dict
    results: list[ReplayResult] = field(default_factory=list)
    optimum: list[Optimum] = field(default_factory=list)
    fairness: list[dict] = field(default_factory=list)  # ``FairnessRow.as_dict()``, if run
    retention: list[ReplayResult] = field(default_factory=list)  # ``run_retention_sweep``

    def result(self, capacity: int, policy: str, index: str) -> ReplayResult:
        """The replay of one (capacity, policy, index)."""
        for item in self.results:
            if (item.capacity, item.policy, item.index) == (capacity, policy, index):
                return item
        raise KeyError((capacity, policy, index))

    def restricted(self, capacities: list[int]) -> SweepReport:
        """The same report with only the results (and optima) at ``capacities``."""
        keep = set(capacities)
        results = [run for run in self.results if run.capacity in keep]
        return SweepReport(self.trace, results, [o for o in self.optimum if o.capacity in keep])


def summarize(trace: Trace, block_size: int) -> dict:
    """Requests, block references, distinct blocks and the unbounded cache's hit rate."""
    references = block_references(trace, 0, block_size)
    total = sum(len(ids) for ids in references)
    repeats = infinite_hits(references)
    return {
        "path": trace.path,
        "format": trace.format_name,
        "block_size": block_tokens(trace, block_size),
        "requests": len(trace.requests),
        "block_references": total,
        "distinct_blocks": len({block for ids in references for block in ids}),
        "infinite_block_hit_rate": repeats / total if total else 0.0,
    }


def run_sweep(
    trace: Trace,
    capacities: list[int],
    policies: list[str],
    indexes: list[str],
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    optimum: bool = True,
    progress: Progress | None = None,
    kv: KVModel | None = None,
) -> SweepReport:
    """Replay every combination (capacities ascending) and compute the optimum (not with
    window groups: MIN counts whole blocks, not their pages)."""
    optimum = optimum and not (kv and kv.windowed)
    report = SweepReport(summarize(trace, block_size))
    for capacity in sorted(set(capacities)):
        for index in indexes:
            for policy in policies:
                run = replay(
                    trace, capacity, policy, index, block_size=block_size, progress=progress,
                    kv=kv,
                )  # fmt: skip
                report.results.append(run)
        if optimum:
            report.optimum.append(compute_optimum(trace, capacity, block_size, report.results[-1]))
    return report


def compute_optimum(trace: Trace, capacity: int, block_size: int, run: ReplayResult) -> Optimum:
    """MIN at ``capacity``; the denominator is the replay's own block lookups."""
    start = time.perf_counter()
    hits = min(belady_hits(block_references(trace, capacity, block_size), capacity), run.blocks)
    seconds = time.perf_counter() - start
    return Optimum(capacity, hits, hits / run.blocks if run.blocks else 0.0, seconds)


def run_retention_sweep(
    trace: Trace,
    capacities: list[int],
    policy: str,
    ttls: list[float],
    budgets: list[float],
    prefixes: list[int | None] | None = None,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    progress: Progress | None = None,
    kv: KVModel | None = None,
) -> list[ReplayResult]:
    """At each capacity: no retention (TTL 0), then every TTL x budget x prefix (blocks
    marked per prompt; None: the whole prompt)."""
    runs = []
    for capacity in sorted(set(capacities)):
        models = [RetentionModel(0.0)]
        models += [
            RetentionModel(ttl, budget, prefix)
            for ttl in ttls
            for budget in budgets
            for prefix in prefixes or [None]
        ]
        for model in models:
            runs.append(
                replay(
                    trace,
                    capacity,
                    policy,
                    block_size=block_size,
                    progress=progress,
                    retention=model,
                    kv=kv,
                )
            )
    return runs
