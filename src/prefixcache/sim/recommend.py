"""``simulate --recommend``: which eviction policy fits this traffic at this pool size.

Every policy is replayed over a ladder of capacities around the operator's. A policy is
*safe* if it serves at least as many blocks as LRU at every capacity of the ladder; the
recommendation is the safe policy with the most hits at the operator's capacity (LRU
itself when no other policy is safe, or none beats it there). Its lead comes with a 95%
interval over slices of the trace (``confidence``); a lead within the noise leaves LRU as
the honest answer, and the output says so.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from prefixcache.cache.policies import POLICY_NAMES
from prefixcache.sim.confidence import Lead, lead_over
from prefixcache.sim.replay import largest_request
from prefixcache.sim.sweep import SweepReport
from prefixcache.sim.traces import Trace

REFERENCE = "lru"
LADDER = (0.25, 0.5, 1.0, 2.0, 4.0)  # capacities tried, as multiples of the operator's


def ladder(capacity: int, smallest: int) -> list[int]:
    """The capacities to sweep for ``capacity``: a quarter to four times it, all feasible."""
    return sorted({max(smallest, round(capacity * factor)) for factor in LADDER})


@dataclass(slots=True)
class Recommendation:
    """The pick for one capacity, its margin over LRU and where every other policy stands."""

    capacity: int
    policy: str
    hit_rate: float
    lru_hit_rate: float
    optimum: float | None
    worst_margin: float  # the policy's smallest lead over LRU on the ladder, in points
    worst_at: int
    rates: dict[str, float]  # every policy's block hit rate at ``capacity``
    unsafe: dict[str, int]  # policy -> a capacity where it served fewer blocks than LRU
    lead: Lead | None = None  # the best safe policy's lead at ``capacity``, with its interval
    contender: str | None = None  # that policy, when its lead was noise and LRU stays

    @property
    def margin(self) -> float:
        """Lead over LRU at the operator's capacity, in percentage points."""
        return 100 * (self.hit_rate - self.lru_hit_rate)

    @property
    def gap_closed(self) -> float | None:
        """Share of the LRU-to-optimum gap closed at the operator's capacity."""
        if self.optimum is None or self.optimum <= self.lru_hit_rate:
            return None
        return (self.hit_rate - self.lru_hit_rate) / (self.optimum - self.lru_hit_rate)


def recommend(report: SweepReport, capacity: int, index: str = "hash") -> Recommendation:
    """The safe policy with the most hits at ``capacity`` (``report`` swept its ladder)."""
    capacities = sorted({run.capacity for run in report.results})
    policies = list(dict.fromkeys(run.policy for run in report.results))
    unsafe = _unsafe(report, capacities, policies, index)
    rates = {p: report.result(capacity, p, index).block_hit_rate for p in policies}
    safe = [p for p in policies if p not in unsafe]
    best = max(safe, key=lambda p: (report.result(capacity, p, index).hit_blocks, p == REFERENCE))
    margins = [(_margin(report, c, best, index), c) for c in capacities]
    worst_margin, worst_at = min(margins)
    optimum = {item.capacity: item.block_hit_rate for item in report.optimum}.get(capacity)
    result = report.result
    lead = lead_over(result(capacity, best, index), result(capacity, REFERENCE, index))
    pick = Recommendation(
        capacity, best, rates[best], rates[REFERENCE], optimum, worst_margin, worst_at, rates,
        unsafe, lead,
    )  # fmt: skip
    if best != REFERENCE and lead is not None and not lead.significant:
        pick.contender, pick.policy, pick.hit_rate = best, REFERENCE, rates[REFERENCE]
        pick.worst_margin, pick.worst_at = 0.0, capacity
    return pick


def _unsafe(report: SweepReport, capacities: list[int], policies: list[str], index: str) -> dict:
    """Each policy that served fewer blocks than LRU somewhere, with the first such capacity."""
    unsafe = {}
    for policy in policies:
        for capacity in capacities:
            ours = report.result(capacity, policy, index).hit_blocks
            if ours < report.result(capacity, REFERENCE, index).hit_blocks:
                unsafe[policy] = capacity
                break
    return unsafe


def _margin(report: SweepReport, capacity: int, policy: str, index: str) -> float:
    ours = report.result(capacity, policy, index).block_hit_rate
    return 100 * (ours - report.result(capacity, REFERENCE, index).block_hit_rate)


def format_recommendation(pick: Recommendation, capacities: list[int]) -> str:
    """The recommendation in a few lines: the pick, its margin, the others."""
    lines = [f"recommended eviction policy at {pick.capacity:,} blocks: {pick.policy}"]
    lead = f"block hit rate {100 * pick.hit_rate:.2f}% vs lru {100 * pick.lru_hit_rate:.2f}%"
    lead += f" ({pick.margin:+.2f} points"
    if pick.gap_closed is not None:
        lead += (
            f", {100 * pick.gap_closed:.0f}% of the gap to the optimum {100 * pick.optimum:.2f}%"
        )
    lines.append("  " + lead + ")")
    ladder_text = ", ".join(f"{c:,}" for c in capacities)
    if pick.contender is not None:
        lines.append(
            f"  lru is the honest answer: {pick.contender} leads by {_interval(pick.lead)}, "
            "which reaches zero"
        )
    elif pick.policy == REFERENCE:
        lines.append(f"  no other policy beats lru here and stays at or above it at {ladder_text}")
    else:
        lines.append(
            f"  never below lru at {ladder_text} blocks; smallest lead "
            f"{pick.worst_margin:+.2f} points at {pick.worst_at:,}"
        )
        if pick.lead is not None:
            lines.append(f"  confidence: lead {_interval(pick.lead)}")
    others = [f"{p} {100 * r:.2f}%" for p, r in pick.rates.items() if p != pick.policy]
    lines.append("  others at this capacity: " + ", ".join(others))
    if pick.unsafe:
        below = ", ".join(f"{p} (at {c:,})" for p, c in pick.unsafe.items())
        lines.append(f"  not safe here (below lru somewhere on the ladder): {below}")
    if pick.policy != REFERENCE:
        lines.append(f"  use it: prefixcache serve --eviction-policy {pick.policy}")
    return "\n".join(lines)


def _interval(lead: Lead) -> str:
    return (
        f"{lead.points:+.2f} points (95% interval {lead.low:+.2f} to {lead.high:+.2f} "
        f"over {lead.slices} slices of the trace)"
    )


def sweep_plan(trace: Trace, args: argparse.Namespace) -> tuple[list[int], list[str]]:
    """Capacities and policies to replay: as given, or every policy on each --capacity's ladder."""
    if not args.recommend:
        return list(args.capacity), list(dict.fromkeys(args.policy))
    smallest = max(1, largest_request(trace, args.block_size))
    capacities = {c for capacity in args.capacity for c in ladder(capacity, smallest)}
    return sorted(capacities), list(POLICY_NAMES)


def format_recommendations(report: SweepReport, capacities: list[int], index: str) -> str:
    """One recommendation per operator capacity, each judged on its own ladder."""
    smallest = min(run.capacity for run in report.results)
    parts = []
    for capacity in dict.fromkeys(capacities):
        steps = ladder(capacity, smallest)
        pick = recommend(report.restricted(steps), capacity, index)
        parts.append(format_recommendation(pick, steps))
    return "\n".join(parts)
