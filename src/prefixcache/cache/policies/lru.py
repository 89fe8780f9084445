"""LRU as a policy object: the free queue itself, for pools that keep several of them."""

from __future__ import annotations

from collections.abc import Iterator

from prefixcache.cache.block_pool import Block, FreeBlockQueue
from prefixcache.cache.integrity import check_queue
from prefixcache.cache.policies.base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    """Victims in release order, exactly as the plain pool's free queue.

    The plain pool needs no policy object for LRU; a fair pool keeps one free queue per
    owner (``FairBlockPool``), and this is that queue behind the policy interface.
    """

    name = "lru"

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.queue = FreeBlockQueue([])

    def touch(self, blocks: list[Block]) -> None:
        """Unlink the free ones (inlined, as the pool's own ``touch``: the hot path)."""
        unlinked = 0
        for block in blocks:
            if block.ref_cnt == 0:
                prev, nxt = block.prev_free, block.next_free
                prev.next_free, nxt.prev_free = nxt, prev
                block.prev_free = block.next_free = None
                unlinked += 1
        self.queue.size -= unlinked

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
