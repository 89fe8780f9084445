"""How sure ``--recommend`` is of a lead over LRU: the lead over slices of the trace.

The same trace replayed by two policies gives per-request hit counts; the trace is cut
into consecutive slices and the lead (hit blocks over LRU's, in points of the block hit
rate) measured on each. The slices' spread gives a 95% interval (Student's t); a lead
whose interval reaches zero is noise, and LRU stays the honest answer.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from prefixcache.sim.replay import ReplayResult

SLICES = 20
T_95 = {4: 2.776, 9: 2.262, 19: 2.093}  # Student's t, two-sided 95%, by degrees of freedom


@dataclass(slots=True, frozen=True)
class Lead:
    """A lead over LRU in points, with its 95% interval over ``slices`` slices."""

    points: float
    low: float
    high: float
    slices: int

    @property
    def significant(self) -> bool:
        return self.low > 0.0


def lead_over(ours: ReplayResult, lru: ReplayResult) -> Lead | None:
    """The lead of ``ours`` over ``lru`` and its interval; None without per-request hits."""
    mine, theirs = ours.hits_per_request, lru.hits_per_request
    if not mine or len(mine) != len(theirs) or not ours.blocks:
        return None
    slices = next((count for count in (SLICES, 10, 5) if count <= len(mine)), None)
    if slices is None:
        return None
    per_slice = [0.0] * slices
    for number, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        per_slice[number * slices // len(mine)] += a - b
    scale = 100.0 * slices / ours.blocks  # a slice's hit blocks, as points of the whole rate
    leads = [difference * scale for difference in per_slice]
    mean = statistics.fmean(leads)
    half = T_95[slices - 1] * statistics.stdev(leads) / math.sqrt(slices)
    return Lead(mean, mean - half, mean + half, slices)
