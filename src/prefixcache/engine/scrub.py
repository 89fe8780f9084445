"""Zero on evict: a block's old K/V is wiped before its slot is handed to new content.

Eviction in the cache is logical (the mapping goes, the bytes stay). With
``EngineConfig.zero_on_evict`` every block a request wrote is zeroed when the pool hands
its slot out again; with a request's own ``zero_on_evict`` only the blocks that request
wrote are. The engine remembers which slots hold such K/V (a set of block ids, filled
as chunks are scheduled) and asks the cache which slots it reallocated since the last
step; the intersection is zeroed before the next forward or copy writes into it.
"""

from __future__ import annotations

from collections.abc import Iterable

from prefixcache.cache import KVCacheManager
from prefixcache.cache.common import cdiv
from prefixcache.engine.kv_store import KVStore
from prefixcache.engine.scheduler import ScheduledChunk


class BlockScrubber:
    """Tracks slots holding K/V to wipe, and zeroes them when the pool reuses them."""

    def __init__(self, manager: KVCacheManager, kv_store: KVStore, zero_on_evict: bool) -> None:
        self.manager = manager
        self.kv_store = kv_store
        self.zero_on_evict = zero_on_evict  # every request's blocks, not just those asking
        self.active = False
        self.written: set[int] = set()  # block ids holding K/V that must not outlive reuse
        if zero_on_evict:
            self.activate()

    def activate(self) -> None:
        """Start tracking (at the first request that asks; nothing before it needs zeroing)."""
        if not self.active:
            self.active = True
            self.manager.record_reused_blocks()

    def track(self, chunks: Iterable[ScheduledChunk]) -> None:
        """Remember the blocks these chunks write, for requests whose KV must be zeroed."""
        if not self.active:
            return
        block_size = self.manager.block_size
        for chunk in chunks:
            if self.zero_on_evict or chunk.branch.request.zero_on_evict:
                first = chunk.start // block_size
                end = cdiv(chunk.start + chunk.num_tokens, block_size)
                self.written.update(chunk.branch.seq.block_table[first:end])

    def zero_reused(self) -> None:
        """Zero every reallocated block that still holds tracked K/V."""
        if not self.active:
            return
        reused = dict.fromkeys(self.manager.pop_reused_blocks())  # a slot may recur in a step
        dirty = [block for block in reused if block in self.written]
        if dirty:
            self.written.difference_update(dirty)
            self.kv_store.zero_blocks(dirty)
