"""Tenant fairness of a replay: per-tenant hit rates with and without owner shares, Jain's index.

The shared pool is the sweep's own replay (one eviction order for everyone); the fair pool
replays the same trace with each request's tenant as its owner (``OwnerParts``). Jain's
fairness index over the tenants' token hit rates is (sum x)^2 / (n * sum x^2): 1 when every
tenant hits equally, 1/n when one tenant has all the hits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from prefixcache.sim.kv_model import KVModel
from prefixcache.sim.replay import Progress, ReplayResult, replay
from prefixcache.sim.sweep import SweepReport
from prefixcache.sim.traces import Trace

MAX_TENANT_COLUMNS = 8  # more tenants: the table shows the lowest and highest rate


def jain_index(values: Sequence[float]) -> float:
    """Jain's fairness index of ``values`` (1.0 for none, or all zero)."""
    squares = sum(value * value for value in values)
    return sum(values) ** 2 / (len(values) * squares) if squares else 1.0


def tenant_hit_rates(run: ReplayResult) -> dict[str, float]:
    """Token hit rate per tenant, by tenant name."""
    return {name: hits / tokens if tokens else 0.0 for name, (tokens, hits) in run.tenants.items()}


def tenants_of(trace: Trace) -> list[str]:
    """The trace's tenant names, sorted (requests without one are not a tenant)."""
    return sorted({request.tenant for request in trace.requests if request.tenant is not None})


@dataclass(slots=True)
class FairnessRow:
    """One capacity and policy: the shared pool's replay and the fair pool's."""

    capacity: int
    policy: str
    shared: ReplayResult
    fair: ReplayResult

    def as_dict(self) -> dict:
        """Plain data for ``--out`` JSON: both pools' per-tenant rates and Jain's index."""
        data: dict = {"capacity": self.capacity, "policy": self.policy}
        for pool, run in (("shared", self.shared), ("fair", self.fair)):
            rates = tenant_hit_rates(run)
            data[pool] = {
                "tenant_hit_rates": rates,
                "jain_index": jain_index(list(rates.values())),
                "token_hit_rate": run.token_hit_rate,
            }
        return data


def run_fairness(
    trace: Trace,
    report: SweepReport,
    shares: Mapping[str, float],
    *,
    block_size: int,
    progress: Progress | None = None,
    kv: KVModel | None = None,
) -> list[FairnessRow]:
    """Replay each of the sweep's (capacity, policy) through a fair pool (its first index)."""
    rows = []
    index = report.results[0].index
    for shared in (run for run in report.results if run.index == index):
        fair = replay(
            trace,
            shared.capacity,
            shared.policy,
            index,
            block_size=block_size,
            progress=progress,
            owner_shares=shares,
            kv=kv,
        )
        rows.append(FairnessRow(shared.capacity, shared.policy, shared, fair))
    return rows


def format_fairness(rows: list[FairnessRow], tenants: list[str], shares: Mapping) -> str:
    """Per capacity and policy, a line for the shared pool and one for the fair pool."""
    listed = ", ".join(f"{name} {share:g}" for name, share in shares.items())
    wide = len(tenants) > MAX_TENANT_COLUMNS
    columns = ["min", "max"] if wide else tenants
    header = ["capacity", "policy", "pool", *columns, "all", "Jain"]
    lines = [
        f"tenant fairness: token hit rate (%) per tenant, {len(tenants)} tenants; shares: "
        f"{listed + ', ' if listed else ''}the rest split equally",
        " ".join(f"{name:>9}" for name in header),
    ]
    for row in rows:
        for pool, run in (("shared", row.shared), ("fair", row.fair)):
            rates = tenant_hit_rates(run)
            values = [rates.get(name, 0.0) for name in tenants]
            shown = [min(values), max(values)] if wide else values
            cells = [f"{row.capacity:>9}", f"{row.policy:>9}", f"{pool:>9}"]
            cells += [f"{100 * value:>9.2f}" for value in shown]
            cells += [f"{100 * run.token_hit_rate:>9.2f}", f"{jain_index(values):>9.3f}"]
            lines.append(" ".join(cells))
    return "\n".join(lines)
