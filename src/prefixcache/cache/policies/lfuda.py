"""LFU with dynamic aging over the protected part."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from prefixcache.cache.blocks import Block
from prefixcache.cache.common import require
from prefixcache.cache.policies.base import NOWHERE
from prefixcache.cache.policies.signals import Ghosts
from prefixcache.cache.policies.split import SplitPolicy


class LFUDAPolicy(SplitPolicy):
    """LFU with dynamic aging (Arlitt et al., 2000) over the protected part.

    Content seen before is protected and ordered by ``age + references`` (references are
    counted per content and remembered by digest after an eviction); ``age`` is the priority
    of the last block demoted, so content popular long ago ages out. New content waits in
    probation; the protected part's size is learned (``SplitPolicy``).
    """

    name = "lfuda"

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.age = 0
        self.refs = [0] * num_blocks  # references of the content a block holds
        self.entries: list[list | None] = [None] * num_blocks  # live heap entry per block
        self.heap: list[list] = []
        self.heap_size = 0
        self._order = itertools.count()
        self.past_refs = Ghosts(num_blocks)  # digest -> references, after an eviction

    def touch(self, blocks: list[Block]) -> None:
        refs = self.refs
        for block in blocks:
            refs[block.block_id] += 1
        super().touch(blocks)

    def disown(self, block: Block) -> None:
        super().disown(block)
        self.refs[block.block_id] = 0

    def _place(self, block: Block, seen: bool) -> None:
        if self.refs[block.block_id] == 0:  # new content recalls its past references
            self.refs[block.block_id] = (self.past_refs.pop(block.digest) or 0) + 1
        super()._place(block, seen)

    def _protect(self, block: Block) -> None:
        entry = [self.age + self.refs[block.block_id], next(self._order), block]
        self.entries[block.block_id] = entry
        heapq.heappush(self.heap, entry)
        self.heap_size += 1

    def _unprotect(self, block: Block) -> None:
        self.entries[block.block_id][2] = None  # deleted lazily from the heap
        self.entries[block.block_id] = None
        self.heap_size -= 1
        if len(self.heap) > 2 * self.heap_size + 64:
            self.heap[:] = [entry for entry in self.heap if entry[2] is not None]
            heapq.heapify(self.heap)

    def _protect_pop(self) -> Block:
        while True:
            priority, _, block = heapq.heappop(self.heap)
            if block is not None:
                break
        self.age = priority
        self.entries[block.block_id] = None
        self.heap_size -= 1
        self.where[block.block_id] = NOWHERE
        return block

    def _protected_size(self) -> int:
        return self.heap_size

    def _protected_blocks(self) -> Iterator[Block]:
        return (entry[2] for entry in self.heap if entry[2] is not None)

    def _remember(self, block: Block, source: int) -> None:
        super()._remember(block, source)
        self.past_refs.add(block.digest, self.refs[block.block_id])
        self.refs[block.block_id] = 0

    def check(self) -> None:
        super().check()
        live = [entry for entry in self.heap if entry[2] is not None]
        require(len(live) == self.heap_size, f"lfuda: {len(live)} live, size {self.heap_size}")
        for entry in live:
            block = entry[2]
            require(self.entries[block.block_id] is entry, f"lfuda: {block} has a stale entry")
