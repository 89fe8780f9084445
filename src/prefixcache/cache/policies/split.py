"""Policies with a probation and an adaptive protected part: SLRU and ARC."""

from __future__ import annotations

from collections.abc import Iterator

from prefixcache.cache.blocks import Block, FreeBlockQueue, check_queue
from prefixcache.cache.common import require
from prefixcache.cache.policies.base import (
    FROM_PROBATION,
    FROM_PROTECTED,
    NOWHERE,
    PROBATION,
    PROTECTED,
)
from prefixcache.cache.policies.signal_policy import SignalPolicy


class SplitPolicy(SignalPolicy):
    """A probation part (LRU) and a protected part whose size ghost lists adapt (ARC's rule).

    Content seen before is protected. Victims come from probation's head; a protected part
    over ``limit`` demotes its least valuable block to probation's tail. Recomputing content
    evicted from probation lowers ``limit``, content evicted after protection raises it. At
    ``limit`` 0 every block passes through probation in release order: exactly LRU.
    """

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.probation = FreeBlockQueue([])
        self.demoted = [False] * num_blocks  # in probation after a demotion
        self.limit = 0.0

    caution = 2.0  # a protected part grows only on twice the evidence that shrinks it

    def _ghost_hit(self, source: int) -> None:
        native, protected = len(self.ghosts[FROM_PROBATION]), len(self.ghosts[FROM_PROTECTED])
        if source == FROM_PROBATION:  # the protected part squeezed probation too hard
            step = self.caution * max(1.0, protected / max(1, native))
            self.limit = max(0.0, self.limit - step)
        elif source == FROM_PROTECTED:  # the protected part was too small
            self.limit = min(
                float(self.num_blocks), self.limit + max(1.0, native / max(1, protected))
            )

    def _place(self, block: Block, seen: bool) -> None:
        if seen:
            self.where[block.block_id] = PROTECTED
            self._protect(block)
            while self._protected_size() > self.limit:
                self._to_probation(self._protect_pop(), demoted=True)
        else:
            self._to_probation(block, demoted=False)

    def _to_probation(self, block: Block, demoted: bool) -> None:
        self.where[block.block_id] = PROBATION
        self.demoted[block.block_id] = demoted
        self.probation.append(block)

    def _select(self) -> Block:
        """Probation's head (the protected part's least valuable if probation is empty)."""
        if self.probation.size:
            return self.probation.head.next_free
        block = self._protect_pop()
        self._to_probation(block, demoted=True)
        return block

    def _source(self, block: Block) -> int:
        where = self.where[block.block_id]
        if where == PROTECTED or (where == PROBATION and self.demoted[block.block_id]):
            return FROM_PROTECTED
        return super()._source(block)

    def _part_size(self, source: int) -> int:
        if source == FROM_PROTECTED:
            return self._protected_size()
        return self.probation.size if source == FROM_PROBATION else self.doomed.size

    def _detach(self, block: Block) -> None:
        if self.where[block.block_id] == PROBATION:
            self.probation.remove(block)
        else:
            self._unprotect(block)

    def _held(self) -> Iterator[Block]:
        yield from self.probation
        yield from self._protected_blocks()

    # ------------------------------------------------- the protected part's order
    def _protect(self, block: Block) -> None:
        raise NotImplementedError

    def _unprotect(self, block: Block) -> None:
        raise NotImplementedError

    def _protect_pop(self) -> Block:
        """Remove and return the protected block to demote (or evict) first."""
        raise NotImplementedError

    def _protected_size(self) -> int:
        raise NotImplementedError

    def _protected_blocks(self) -> Iterator[Block]:
        raise NotImplementedError

    def check(self) -> None:
        super().check()
        for block_id in check_queue(self.probation, f"{self.name} probation"):
            require(self.where[block_id] == PROBATION, f"{self.name}: block {block_id} lost")
        for block in self._protected_blocks():
            require(self.where[block.block_id] == PROTECTED, f"{self.name}: {block} lost")
        require(0.0 <= self.limit <= self.num_blocks, f"{self.name}: limit {self.limit}")


class LRUProtected(SplitPolicy):
    """A protected part in LRU order (an intrusive queue)."""

    def __init__(self, num_blocks: int) -> None:
        self.protected = FreeBlockQueue([])
        super().__init__(num_blocks)

    def _protect(self, block: Block) -> None:
        self.protected.append(block)

    def _unprotect(self, block: Block) -> None:
        self.protected.remove(block)

    def _protect_pop(self) -> Block:
        block = self.protected.popleft()
        self.where[block.block_id] = NOWHERE
        return block

    def _protected_size(self) -> int:
        return self.protected.size

    def _protected_blocks(self) -> Iterator[Block]:
        return iter(self.protected)

    def check(self) -> None:
        check_queue(self.protected, f"{self.name} protected")
        super().check()


class SLRUPolicy(LRUProtected):
    """Segmented LRU with an adaptive protected share (``SplitPolicy``).

    A fixed share is right while the cache is small and wrong once it holds most of the
    working set: it keeps stale "seen twice" blocks and drops the fresh ones the next turn
    of a conversation needs. Here ghost lists move the share to whichever part lost hits.
    """

    name = "slru"


class ARCPolicy(LRUProtected):
    """ARC (Megiddo and Modha, FAST'03) over the free cached blocks.

    Content seen once waits in a recency part (probation), content seen again in a
    frequency part (protected); ghost hits move the target split (``limit`` is the frequency
    part's share, ARC's ``c - p``). Nothing is demoted: the victim is probation's head while
    probation is over its target, else the older of the two heads. ARC proper evicts the
    frequency part's head there; taking the older one makes ``limit`` 0 exactly LRU, where
    this ARC starts (ARC proper starts at the other end).
    """

    name = "arc"
    caution = 1.0  # ARC's own symmetric steps

    def _place(self, block: Block, seen: bool) -> None:
        if seen:
            self.where[block.block_id] = PROTECTED
            self._protect(block)
        else:
            self._to_probation(block, demoted=False)

    def _select(self) -> Block:
        """Probation's head while it is over its target, else the older of the two heads."""
        recent, frequent = self.probation, self.protected
        if not frequent.size:
            return recent.head.next_free
        if not recent.size:
            return frequent.head.next_free
        if recent.size > self.num_blocks - self.limit:
            return recent.head.next_free
        first, second = recent.head.next_free, frequent.head.next_free
        older = self.released_at[first.block_id] <= self.released_at[second.block_id]
        return first if older else second
