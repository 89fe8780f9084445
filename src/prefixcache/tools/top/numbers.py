"""What the view shows of one replica, computed from its window of scrapes (numbers only)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixcache.tools.top.samples import Samples, Window

P = "prefixcache_"
STATES = ("running", "cached", "retained", "free")


@dataclass(frozen=True, slots=True)
class TenantRow:
    """One tenant: its share of the cached pool (None: not fair), blocks, churn, requests."""

    name: str
    share: float | None
    share_blocks: int | None  # the share as blocks of the pool
    cached: int | None  # free cached blocks charged to it (fair pools only)
    retained: int
    evicted: float | None  # its cached blocks evicted over the window
    requests: float  # finished requests over the window


@dataclass(frozen=True, slots=True)
class Tier:
    """The second tier over the window: blocks found and not, mean fetch latency."""

    medium: str
    hits: float
    misses: float
    load_ms: float | None
    breaker: str | None
    errors: float


@dataclass(frozen=True, slots=True)
class ReplicaNumbers:
    """One replica's numbers: the pool now, and changes over ``seconds`` (0: since start)."""

    seconds: float
    blocks: int
    states: dict[str, int]
    hit_rate: float | None  # hit tokens / looked-up tokens
    hit_tokens: float
    saved_seconds: float
    evictions: float
    running: int
    waiting: int
    pending: int
    step_ms: float | None
    step_target_ms: float | None
    tier: Tier | None
    tenants: list[TenantRow] = field(default_factory=list)

    @property
    def evictions_per_s(self) -> float | None:
        return self.evictions / self.seconds if self.seconds else None


def replica_numbers(window: Window) -> ReplicaNumbers | None:
    """The numbers of the window's scrapes; None before the first one."""
    now = window.latest
    if now is None:
        return None
    hits = window.change(P + "prefix_cache_hits_tokens_total") or 0.0
    queries = window.change(P + "prefix_cache_queries_tokens_total") or 0.0
    steps = window.change(P + "step_seconds_count") or 0.0
    step_sum = window.change(P + "step_seconds_sum") or 0.0
    target = now.get(P + "step_target_seconds")
    return ReplicaNumbers(
        seconds=window.seconds,
        blocks=_int(now.get(P + "kv_blocks")),
        states={state: _int(now.get(P + "kv_blocks_by_state", state=state)) for state in STATES},
        hit_rate=hits / queries if queries else None,
        hit_tokens=hits,
        saved_seconds=window.change(P + "prefill_seconds_saved_total") or 0.0,
        evictions=window.change(P + "kv_evictions_total") or 0.0,
        running=_int(now.get(P + "requests_running")),
        waiting=_int(now.get(P + "requests_waiting")),
        pending=_int(now.get(P + "requests_pending")),
        step_ms=1000 * step_sum / steps if steps else None,
        step_target_ms=None if target is None else 1000 * target,
        tier=_tier(window, now),
        tenants=_tenants(window, now),
    )


def _int(value: float | None) -> int:
    return 0 if value is None else int(value)


def _tier(window: Window, now: Samples) -> Tier | None:
    """The tier's numbers, if the replica has one."""
    media = now.by_label(P + "tier_lookups_total", "medium")
    if not media:
        return None
    medium = next(iter(media))
    loads = window.change(P + "tier_loads_total") or 0.0
    load_seconds = window.change(P + "tier_load_seconds_total") or 0.0
    breaker = [s for s, on in now.by_label(P + "tier_breaker_state", "state").items() if on]
    return Tier(
        medium,
        window.change(P + "tier_hit_blocks_total") or 0.0,
        window.change(P + "tier_miss_blocks_total") or 0.0,
        1000 * load_seconds / loads if loads else None,
        breaker[0] if breaker else None,
        window.change(P + "tier_errors_total") or 0.0,
    )


def _tenants(window: Window, now: Samples) -> list[TenantRow]:
    """Every tenant seen in the shares, retention marks or finished requests."""
    shares = now.by_label(P + "tenant_cache_share", "tenant")
    cached = now.by_label(P + "tenant_cached_blocks", "tenant")
    retained = now.by_label(P + "retained_blocks", "tenant")
    evicted = dict(window.changes(P + "tenant_evictions_suffered_total", "tenant"))
    requests = dict(window.changes(P + "requests_total", "tenant"))
    blocks = _int(now.get(P + "kv_blocks"))
    names = sorted({*shares, *retained, *requests})
    return [
        TenantRow(
            name,
            shares.get(name),
            None if name not in shares else int(shares[name] * blocks),
            None if name not in cached else int(cached[name]),
            int(retained.get(name, 0)),
            evicted.get(name),
            requests.get(name, 0.0),
        )
        for name in names
    ]


def merge_tenants(replicas: list[ReplicaNumbers]) -> list[TenantRow]:
    """Tenants summed over replicas: blocks, shares as blocks, churn and requests."""
    merged: dict[str, TenantRow] = {}
    for numbers in replicas:
        for row in numbers.tenants:
            seen = merged.get(row.name)
            merged[row.name] = row if seen is None else _add(seen, row)
    return [merged[name] for name in sorted(merged)]


def _add(a: TenantRow, b: TenantRow) -> TenantRow:
    """Two replicas' rows of one tenant, summed (a share is the same on every replica)."""
    return TenantRow(
        a.name,
        a.share if a.share is not None else b.share,
        _plus(a.share_blocks, b.share_blocks),
        _plus(a.cached, b.cached),
        a.retained + b.retained,
        None if a.evicted is None and b.evicted is None else (a.evicted or 0) + (b.evicted or 0),
        a.requests + b.requests,
    )


def _plus(x: int | None, y: int | None) -> int | None:
    return None if x is None and y is None else (x or 0) + (y or 0)
