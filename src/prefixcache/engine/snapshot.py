"""EngineSnapshot: the engine's numbers, built on the engine thread for every other thread.

The engine thread (``AsyncLLMEngine._run``) publishes one as ``LLMEngine.snapshot`` by a
single attribute assignment after each step, after the commands it runs between steps, and
while idle; a metrics scrape reads only that record, never the live manager, scheduler or
tier link.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prefixcache.cache.chains import pool_states
from prefixcache.cache.owners import OwnerUsage

if TYPE_CHECKING:
    from prefixcache.engine.engine import LLMEngine
    from prefixcache.engine.tier_link import TierLink


@dataclass(frozen=True, slots=True)
class TierSnapshot:
    """The second tier's counters, rejected values by reason, timeouts and breaker state."""

    medium: str
    counters: tuple[tuple[str, float], ...]  # every numeric ``TierStats`` field, by name
    rejected: tuple[tuple[str, int], ...]  # (reason, count), sorted by reason
    rejected_files: tuple[tuple[str, int], ...]  # the backend's refused entries, likewise
    timeouts: int  # fetches given up at their deadline
    breaker_state: str  # "closed", "open" or "half_open"

    def counter(self, name: str) -> float:
        """One ``TierStats`` counter by name."""
        return dict(self.counters)[name]


@dataclass(frozen=True, slots=True)
class RetentionCounters:
    """The cache's retention counters (``CacheStats``), cumulative."""

    saved_hits: int
    expired: int
    evictions: int
    refused: int


@dataclass(frozen=True, slots=True)
class WindowCounters:
    """A hybrid layout's window groups: counters (cumulative) and bytes now."""

    pages_released: int  # pages given back mid-run or at the end, still matchable
    pages_evicted: int  # free pages taken for reuse (their block stays cached)
    lost_tokens: int  # prompt tokens the full group held but the windows did not
    bytes_per_cached_token: tuple[tuple[str, float], ...]  # (group, bytes) over cached tokens


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """Pool, cache counters, queues, owners and tier at one instant (numbers only)."""

    taken_at: float  # time.monotonic() when built
    block_size: int
    num_blocks: int
    kv_cache_dtype: str  # what the pool stores K/V as
    kv_bytes_per_token: int  # one cached token across all layers, K and V (int8: scales too)
    kv_layout: str  # hybrid (window groups keep their window only) or full
    windows: WindowCounters | None  # a hybrid layout's
    enable_prefix_caching: bool
    num_free_blocks: int
    pool_states: tuple[tuple[str, int], ...]  # (state, blocks): ``cache.chains.pool_states``
    usage: float  # share of blocks held by live requests
    queries: int  # cache counters (``CacheStats``), cumulative
    hits: int
    tier_hits: int
    evictions: int
    duplicate_blocks: int
    cow_copies: int
    min_free_blocks: int
    num_running: int  # branches
    num_waiting: int
    num_prefill_tokens_pending: int  # prompt tokens still to compute, running and waiting
    num_preemptions: int
    num_fair_deferrals: int
    num_pauses: int  # running prefills paused for a more urgent arrival
    num_long_steps: int  # long prompts' own steps
    num_urgent_steps: int  # steps run between a long step's layers
    step_target: float | None  # seconds (None: steps sized in tokens only)
    step_seconds: tuple[tuple[str, int], ...]  # measured steps: cumulative (le, count)
    step_seconds_sum: float
    queue_seconds: tuple[tuple[str, float], ...]  # (reason, step seconds x branches waiting)
    seconds_per_token: float | None
    owners: tuple[OwnerUsage, ...]  # () unless fair with an owner
    retained: tuple[tuple[str | None, str, int], ...]  # (owner, class, blocks retained now)
    retention: RetentionCounters
    tier: TierSnapshot | None


def take_snapshot(engine: LLMEngine) -> EngineSnapshot:
    """The engine's numbers now (call on the engine thread; per-owner usage is O(owners))."""
    manager, scheduler, stats = engine.manager, engine.scheduler, engine.manager.stats
    return EngineSnapshot(
        taken_at=time.monotonic(),
        block_size=manager.block_size,
        num_blocks=manager.num_blocks,
        kv_cache_dtype=engine.kv_cache_dtype,
        kv_bytes_per_token=engine.kv_store.bytes_per_token,
        kv_layout=engine.layout.name,
        windows=window_counters(engine),
        enable_prefix_caching=engine.config.enable_prefix_caching,
        num_free_blocks=manager.num_free_blocks,
        pool_states=tuple(pool_states(manager.pool).items()),
        usage=manager.usage,
        queries=stats.queries,
        hits=stats.hits,
        tier_hits=stats.tier_hits,
        evictions=stats.evictions,
        duplicate_blocks=stats.duplicate_blocks,
        cow_copies=stats.cow_copies,
        min_free_blocks=stats.min_free_blocks,
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_prefill_tokens_pending=scheduler.pending_prefill_tokens(),
        num_preemptions=scheduler.num_preemptions,
        num_fair_deferrals=scheduler.num_fair_deferrals,
        num_pauses=scheduler.num_pauses,
        num_long_steps=scheduler.num_long_steps,
        num_urgent_steps=scheduler.num_urgent_steps,
        step_target=scheduler.step_target,
        step_seconds=scheduler.step_times.cumulative(),
        step_seconds_sum=scheduler.step_times.total,
        queue_seconds=tuple(scheduler.queue_seconds.items()),
        seconds_per_token=engine.seconds_per_token,
        owners=tuple(manager.owner_usage()),
        retained=retained_by_owner(manager.retention_usage()),
        retention=RetentionCounters(
            stats.retention_saved_hits,
            stats.retention_expired,
            stats.retention_evictions,
            stats.retention_refused,
        ),
        tier=None if engine.tier is None else tier_snapshot(engine.tier),
    )


def retained_by_owner(usage: dict[tuple[str | None, str], int]) -> tuple:
    """``(owner, class, blocks)`` rows, in a stable order."""
    return tuple((owner, klass, count) for (owner, klass), count in sorted(usage.items(), key=str))


def tier_snapshot(tier: TierLink) -> TierSnapshot:
    """The tier link's numbers (``TierClient.stats`` is a copy taken under its lock)."""
    client = tier.client
    stats = client.stats.as_dict()
    rejected = stats.pop("rejected")
    rejected_files = stats.pop("rejected_files")
    return TierSnapshot(
        client.medium,
        tuple(stats.items()),
        tuple(sorted(rejected.items())),
        tuple(sorted(rejected_files.items())),
        tier.timeouts,
        client.breaker_state,
    )


def window_counters(engine: LLMEngine) -> WindowCounters | None:
    """The window groups' numbers (None: an all-full layout): per group, the bytes its
    pages take over the cached tokens (the full group: every cached token has its page)."""
    windows, stats = engine.manager.windows, engine.manager.stats
    if windows is None:
        return None
    page_token = engine.kv_store.bytes_per_page_token
    shares = windows.bytes_per_cached_token(page_token, len(engine.manager.pool.cached))
    per_group = [("full", float(page_token))]
    per_group += [(f"window{group + 1}", share) for group, share in enumerate(shares)]
    return WindowCounters(
        stats.window_pages_released,
        stats.window_pages_evicted,
        stats.window_lost_tokens,
        tuple(per_group),
    )
