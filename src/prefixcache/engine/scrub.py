"""Zero on evict: a block's old K/V is wiped before its slot is handed to new content.

Eviction in the cache is logical (the mapping goes, the bytes stay). With
``EngineConfig.zero_on_evict`` every block a request wrote is zeroed when the pool hands
its slot out again; with per-request ``sensitive`` only the blocks a sensitive request
wrote are. The engine remembers which slots hold such K/V (a set of block ids, filled
as chunks are scheduled) and asks the cache which slots it reallocated since the last
step; the intersection is zeroed before the next forward or copy writes into it.
"""

from __future__ import annotations

from collections.abc import Iterable

from prefixcache.cache import KVCacheManager
from prefixcache.cache.manager import cdiv
from prefixcache.engine.kv_store import KVStore
from prefixcache.engine.scheduler import ScheduledChunk


class BlockScrubber:
    """Tracks slots holding K/V to wipe, and zeroes them when the pool reuses them."""

    def __init__(self, cache: KVCacheManager, kv_store: KVStore, everything: bool) -> None:
        self.cache = cache
        self.kv_store = kv_store
        self.everything = everything  # zero_on_evict: every request counts as sensitive
        self.active = False
        self.written: set[int] = set()  # block ids holding K/V that must not outlive reuse
        self.num_zeroed = 0
        if everything:
            self.activate()

    def activate(self) -> None:
        """Start tracking (at the first sensitive request; nothing before it needs zeroing)."""
        if not self.active:
            self.active = True
            self.cache.record_reused_blocks()

    def track(self, chunks: Iterable[ScheduledChunk]) -> None:
        """Remember the blocks these chunks write, for sensitive requests."""
        if not self.active:
            return
        block_size = self.cache.block_size
        for chunk in chunks:
            if self.everything or chunk.branch.request.sensitive:
                first = chunk.start // block_size
                end = cdiv(chunk.start + chunk.num_tokens, block_size)
                self.written.update(chunk.branch.seq.block_table[first:end])

    def zero_reused(self) -> None:
        """Zero every reallocated block that still holds tracked K/V."""
        if not self.active:
            return
        reused = dict.fromkeys(self.cache.pop_reused_blocks())  # a slot may recur in a step
        dirty = [block for block in reused if block in self.written]
        if dirty:
            self.written.difference_update(dirty)
            self.kv_store.zero_blocks(dirty)
            self.num_zeroed += len(dirty)
