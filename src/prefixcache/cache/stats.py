"""Counters the cache keeps as it works: the raw material for metrics and reports."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class CacheStats:
    """Cumulative cache counters; token counts unless the name says blocks."""

    requests: int = 0  # successful admissions
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens served from the pool
    tier_hits: int = 0  # prompt tokens loaded from a second tier instead of computed
    failed_admissions: int = 0  # admit() returned None: not enough free blocks
    stored_blocks: int = 0  # full blocks that became matchable
    duplicate_blocks: int = 0  # committed blocks whose content was already indexed
    evictions: int = 0  # indexed blocks whose slot was reused for other content
    cow_copies: int = 0  # shared partial blocks copied before an append
    resets: int = 0  # successful reset() calls
    min_free_blocks: int = 0  # low watermark of the free queue
    retention_refused: int = 0  # blocks a retain() left unmarked: the owner's budget was full
    retention_expired: int = 0  # marks that ran out (noticed at a release or an allocation)
    retention_evictions: int = 0  # retained blocks evicted before expiry: nothing else was free
    retention_saved_hits: int = 0  # hits on a free block Retention held (a proxy: see below)
    window_pages_released: int = 0  # window pages a sequence gave back, still matchable
    window_pages_evicted: int = 0  # free window pages taken for reuse (their block stays)
    window_lost_tokens: int = 0  # prompt tokens the full groups held but the windows did not

    # ``retention_saved_hits`` counts hits on free blocks kept out of the policy by an
    # unexpired mark: blocks that might have been evicted without it (a cheap proxy; the
    # policy may have kept some anyway). Marked blocks now: ``KVCacheManager.retained_blocks``.

    @property
    def hit_rate(self) -> float:
        """Share of queried prompt tokens that were served from cache."""
        return self.hits / self.queries if self.queries else 0.0

    def as_dict(self) -> dict[str, float]:
        """All counters plus the hit rate, for reports and JSON."""
        return {**asdict(self), "hit_rate": self.hit_rate}
