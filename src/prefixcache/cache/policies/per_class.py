"""The ``signals`` policy: one LRU list per class of signals, each aging at its own pace."""

from __future__ import annotations

from collections.abc import Iterator

from prefixcache.cache.blocks import Block, FreeBlockQueue, check_queue
from prefixcache.cache.common import require
from prefixcache.cache.policies.base import PROBATION
from prefixcache.cache.policies.signal_policy import SignalPolicy


class SignalsPolicy(SignalPolicy):
    """One LRU list per class of signals; each class ages at the pace its reuse rate sets.

    A block's age is the number of blocks released since it was; the victim is the class
    head with the largest ``age * pace``, where ``pace`` is the average reuse rate over the
    class's own (``ReuseClasses``, within 1/4..4). A class reused half as often as the rest
    is kept half as long. With every pace equal this is LRU, victim for victim.
    """

    name = "signals"

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.lists = [FreeBlockQueue([]) for _ in range(self.classes.count)]

    def _place(self, block: Block, seen: bool) -> None:
        self.where[block.block_id] = PROBATION
        self.lists[self.cls[block.block_id]].append(block)

    def _detach(self, block: Block) -> None:
        self.lists[self.cls[block.block_id]].remove(block)

    def _select(self) -> Block:
        clock, released_at, pace = self.clock, self.released_at, self.classes.pace
        victim, oldest = None, -1.0
        for cls, queue in enumerate(self.lists):
            if queue.size:
                head = queue.head.next_free
                age = (clock - released_at[head.block_id]) * pace[cls]
                if age > oldest:
                    victim, oldest = head, age
        return victim

    def _held(self) -> Iterator[Block]:
        for queue in self.lists:
            yield from queue

    def check(self) -> None:
        super().check()
        for cls, queue in enumerate(self.lists):
            for block_id in check_queue(queue, f"signals class {cls}"):
                require(self.cls[block_id] == cls, f"signals: block {block_id} lost its class")
