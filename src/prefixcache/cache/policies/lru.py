"""LRU, the article's policy and the default: the free blocks in release order."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prefixcache.cache.blocks import Block, FreeBlockQueue, check_queue
from prefixcache.cache.policies.base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    """Victims in release order: the least recently freed cached block goes first.

    The article's intrusive free queue, holding the pool's free cached blocks (a fair pool
    keeps one per owner); blocks holding nothing wait in the pool's own empty queue.
    """

    name = "lru"

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.queue = FreeBlockQueue([])

    def touch(self, blocks: list[Block]) -> None:
        """Unlink the free ones (inlined: this is the hot path of every hit)."""
        unlinked = 0
        for block in blocks:
            if block.ref_cnt == 0:
                prev, nxt = block.prev_free, block.next_free
                prev.next_free, nxt.prev_free = nxt, prev
                block.prev_free = block.next_free = None
                unlinked += 1
        self.queue.size -= unlinked

    def acquire(self, blocks: list[Block]) -> None:
        """A reference on each; free ones leave the queue (one pass, inlined)."""
        unlinked = 0
        for block in blocks:
            if block.ref_cnt:
                block.ref_cnt += 1
            else:
                prev, nxt = block.prev_free, block.next_free
                prev.next_free, nxt.prev_free = nxt, prev
                block.prev_free = block.next_free = None
                block.ref_cnt = 1
                unlinked += 1
        self.queue.size -= unlinked

    def release_refs(self, blocks: Iterable[Block]) -> list[Block]:
        """Drop a reference each; cached ones at 0 are spliced onto the tail as one run, in
        the order given (one pass); returns the ones at 0 holding nothing."""
        queue = self.queue
        tail = queue.tail
        last = tail.prev_free
        linked = 0
        empties = []
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.key is None:
                    empties.append(block)
                else:
                    block.prev_free = last
                    last.next_free = last = block
                    linked += 1
        last.next_free = tail
        tail.prev_free = last
        queue.size += linked
        return empties

    def insert(self, blocks: list[Block]) -> None:
        """Splice them onto the tail as one run, in the order given."""
        queue = self.queue
        tail = queue.tail
        last = tail.prev_free
        for block in blocks:
            block.prev_free = last
            last.next_free = last = block
        last.next_free = tail
        tail.prev_free = last
        queue.size += len(blocks)

    def pop_victim(self) -> Block:
        return self.queue.popleft()

    def clear(self) -> list[Block]:
        blocks = list(self.queue)
        self.queue = FreeBlockQueue([])
        return blocks

    def __len__(self) -> int:
        return self.queue.size

    def __iter__(self) -> Iterator[Block]:
        return iter(self.queue)

    def check(self) -> None:
        check_queue(self.queue, "lru queue")
