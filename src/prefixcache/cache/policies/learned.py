"""The ``learned`` policy: evict the free block least likely to be reused soon.

Free blocks sit in one release-ordered list per class of signals (seen before, last block
of a release), as in ``signals``. A ``ReuseModel`` trained online on what happens to
released blocks (hits, and recomputations the digest history remembers) predicts, for
each class's oldest block at its age, the chance of a reference within the next few pools'
worth of releases; the lowest goes first, doomed blocks before all. Where the model has no
evidence every class shares one curve that never rises with age, so the victim is the
oldest block: LRU. An ``LRUGuard`` replays a sample of the traffic through LRU and, while
the policy trails it by more than chance, evicts in plain LRU order.
"""

from __future__ import annotations

from prefixcache.cache.blocks import Block
from prefixcache.cache.common import require
from prefixcache.cache.policies.lru_guard import LRUGuard
from prefixcache.cache.policies.per_class import SignalsPolicy
from prefixcache.cache.policies.reuse_model import BINS, LAST_BIN, ReuseModel, age_bin

CLOCK_SHIFT = 24  # a history value: release clock above, the release's tag below


class LearnedPolicy(SignalsPolicy):
    """Per-class lists; the victim is the class head the ``ReuseModel`` rates lowest."""

    name = "learned"
    MARGIN = 0.25  # how much less likely to be reused another head must be than the oldest

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.model = ReuseModel(num_blocks, self.classes.count)
        self.guard = LRUGuard(num_blocks)

    def touch(self, blocks: list[Block]) -> None:
        """Hits: a first reuse since release teaches the model its class and age."""
        reused, tag, guard, threshold = self.reused, self.tag, self.guard, self.guard.threshold
        counts, cls, clock, released_at = self.model.reused, self.cls, self.clock, self.released_at
        for block in blocks:
            block_id = block.block_id
            if not reused[block_id] and tag[block_id] >= 0:  # ReuseModel.note_reuse, inlined
                bits = (clock - released_at[block_id]).bit_length()
                counts[cls[block_id]][bits if bits < LAST_BIN else LAST_BIN] += 1.0
            digest = block.digest
            if digest is not None and digest[0] < threshold:  # LRUGuard.sampled, inlined
                guard.reference(digest, hit=True)
        super().touch(blocks)

    def insert(self, blocks: list[Block]) -> None:
        """Releases: content computed anew was a miss (for the guard); count each release."""
        reused, guard, threshold = self.reused, self.guard, self.guard.threshold
        for block in blocks:
            digest = block.digest
            if digest is not None and digest[0] < threshold and not reused[block.block_id]:
                guard.reference(digest, hit=False)  # sampled (inlined, as in touch)
        super().insert(blocks)
        cls = self.cls
        self.model.note_releases([cls[block.block_id] for block in blocks])

    def _history_value(self, block: Block) -> int:
        block_id = block.block_id
        return self.released_at[block_id] << CLOCK_SHIFT | self.tag[block_id]

    def _recalled(self, remembered: int) -> None:
        tag = remembered & ((1 << CLOCK_SHIFT) - 1)
        super()._recalled(tag)
        self.model.note_reuse(tag & 0xFF, self.clock - (remembered >> CLOCK_SHIFT))

    def _choose(self) -> Block:
        """Doomed first and the model's pick while trusted; else the oldest head: LRU."""
        if self.guard.trusted:
            return super()._choose()
        released_at, oldest = self.released_at, None
        for queue in (self.doomed, *self.lists):
            if queue.size:
                head = queue.head.next_free
                if oldest is None or released_at[head.block_id] < released_at[oldest.block_id]:
                    oldest = head
        return oldest

    def _select(self) -> Block:
        """The oldest class head (LRU's victim), unless the model rates another head's
        chance of reuse below ``MARGIN`` times the oldest's: then that one."""
        clock, released_at, prediction = self.clock, self.released_at, self.model.prediction
        oldest = likeliest_dead = None
        oldest_age, lowest = -1, 2.0
        chance_of_oldest = 0.0
        for cls, queue in enumerate(self.lists):
            if queue.size:
                head = queue.head.next_free
                age = clock - released_at[head.block_id]
                chance = prediction[cls][age_bin(age)]
                if age > oldest_age:
                    oldest, oldest_age, chance_of_oldest = head, age, chance
                if chance < lowest:
                    likeliest_dead, lowest = head, chance
        return likeliest_dead if lowest < self.MARGIN * chance_of_oldest else oldest

    def check(self) -> None:
        super().check()
        require(len(self.guard.shadow) <= self.guard.capacity, "learned: shadow LRU overflow")
        require(
            all(len(row) == BINS for row in self.model.prediction), "learned: model shape changed"
        )
