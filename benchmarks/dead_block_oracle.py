"""An upper mark for past-only policies: LRU that knows which blocks are never used again.

Not a product policy: it reads the future. At each release a block whose content no later
request of the trace references is evicted before any other; the rest go in LRU order.
The share of the LRU-to-optimum gap it closes says how much of the gap is conversations
ending (dead blocks) and how much is timing (which live block returns first).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from typing import ClassVar

from prefixcache import KVCacheManager
from prefixcache.cache import policies
from prefixcache.cache.blocks import Block, FreeBlockQueue
from prefixcache.cache.policies.lru import LRUPolicy
from prefixcache.sim.traces import Trace


class DeadBlockOracle(LRUPolicy):
    """LRU, with the blocks the rest of the trace never references evicted first."""

    name = "dead-block-oracle"
    uses: ClassVar[dict[int, list[int]]] = {}  # hash id -> the requests referencing it, in order
    now = 0  # the request being replayed

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.dead = FreeBlockQueue([])
        self.is_dead = [False] * num_blocks

    def touch(self, blocks: list[Block]) -> None:
        for block in blocks:
            if block.ref_cnt == 0:
                (self.dead if self.is_dead[block.block_id] else self.queue).remove(block)

    def acquire(self, blocks: list[Block]) -> None:
        self.touch(blocks)
        for block in blocks:
            block.ref_cnt += 1

    def release_refs(self, blocks):
        return policies.EvictionPolicy.release_refs(self, blocks)

    def insert(self, blocks: list[Block]) -> None:
        for block in blocks:
            uses = self.uses.get(int.from_bytes(block.key[1], "little"), [])
            dead = bisect.bisect_right(uses, self.now) == len(uses)
            self.is_dead[block.block_id] = dead
            (self.dead if dead else self.queue).append(block)

    def pop_victim(self) -> Block:
        return self.dead.popleft() if self.dead.size else self.queue.popleft()

    def clear(self) -> list[Block]:
        blocks = list(self)
        self.__init__(self.num_blocks)
        return blocks

    def __len__(self) -> int:
        return self.dead.size + self.queue.size

    def __iter__(self) -> Iterator[Block]:
        yield from self.dead
        yield from self.queue


def oracle_hit_rate(trace: Trace, capacity: int) -> float:
    """Block hit rate of the dead-block oracle on a Mooncake-format trace."""
    uses: dict[int, list[int]] = {}
    for number, request in enumerate(trace.requests):
        for hash_id in request.hash_ids:
            uses.setdefault(hash_id, []).append(number)
    DeadBlockOracle.uses = uses
    policies.POLICIES[DeadBlockOracle.name] = DeadBlockOracle
    manager = KVCacheManager(capacity, 1, eviction_policy=DeadBlockOracle.name)
    hits = blocks = 0
    for number, request in enumerate(trace.requests):
        DeadBlockOracle.now = number
        seq = manager.admit(str(number), request.hash_ids, cap_last_token=False)
        manager.commit(seq, len(request.hash_ids))
        manager.free(seq)
        hits += seq.num_cached_tokens
        blocks += len(request.hash_ids)
    manager.check_invariants()
    return hits / blocks
