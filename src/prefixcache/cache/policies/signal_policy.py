"""The machinery shared by every policy: classes, doomed blocks first, leaf-first victims."""

from __future__ import annotations

from collections.abc import Iterator

from prefixcache.cache.blocks import Block, FreeBlockQueue, check_queue
from prefixcache.cache.common import require
from prefixcache.cache.policies.base import (
    DEFAULT_SIGNALS,
    DOOMED,
    FROM_DOOMED,
    FROM_PROBATION,
    NOWHERE,
    EvictionPolicy,
)
from prefixcache.cache.policies.signals import ChainDepths, ChainIndex, Ghosts, ReuseClasses


class SignalPolicy(EvictionPolicy):
    """Shared machinery: signals, classes, doomed blocks first, leaf-first victims.

    Subclasses place the blocks that are not doomed (``_place``), pick a victim among them
    (``_select``) and unlink them (``_detach``). Evicted digests go to the ghost list of the
    part they left (doomed, probation, protected); a ghost hit counts as a reuse of the
    evicted block's class, so a class wrongly doomed is soon released from that verdict.
    """

    features: frozenset[str] = DEFAULT_SIGNALS
    leaf_first = True
    HISTORY_POOLS = 4  # evicted digests remembered, in pools' worth

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.where = [NOWHERE] * num_blocks
        self.cls = [-1] * num_blocks  # class of a free block, or of a held one since release
        self.tag = [-1] * num_blocks  # its release's tag (``ReuseClasses.note_release``)
        self.reused = [False] * num_blocks  # referenced again since its last insert
        self.doomed = FreeBlockQueue([])
        self.classes = ReuseClasses(num_blocks, self.features)
        self.depths = ChainDepths() if "depth" in self.features else None
        self.chains = ChainIndex() if self.leaf_first else None
        self.ghosts = (Ghosts(num_blocks), Ghosts(num_blocks), Ghosts(num_blocks))
        self.history = Ghosts(self.HISTORY_POOLS * num_blocks)
        self.released_at = [0] * num_blocks  # the release clock of each free block
        self.clock = 0
        self.size = 0

    def touch(self, blocks: list[Block]) -> None:
        """Hits: each counts as a reuse of its class once; free ones leave the policy."""
        reused, tag = self.reused, self.tag
        for block in blocks:
            block_id = block.block_id
            if not reused[block_id]:
                reused[block_id] = True
                if tag[block_id] >= 0:
                    self.classes.note_reuse(tag[block_id])
            if block.ref_cnt == 0:
                self._unlink(block)

    def _unlink(self, block: Block) -> None:
        block_id = block.block_id
        if self.where[block_id] == DOOMED:
            self.doomed.remove(block)
        else:
            self._detach(block)
        self.where[block_id] = NOWHERE
        self.size -= 1
        if self.chains is not None:
            self.chains.remove(block)

    def insert(self, blocks: list[Block]) -> None:
        """Classify each released block, then doom it or let the subclass place it."""
        depths = self.depths.of_release(blocks) if self.depths is not None else None
        classes, doomed = self.classes, self.classes.doomed
        for position, block in enumerate(blocks):
            block_id = block.block_id
            seen = self.reused[block_id] or self._recall(block)
            self.reused[block_id] = False
            self.clock += 1
            self.released_at[block_id] = self.clock
            cls = classes.classify(seen, position == 0, depths[position] if depths else 0)
            self.tag[block_id] = classes.note_release(cls)
            self.cls[block_id] = cls
            if doomed[cls]:
                self.where[block_id] = DOOMED
                self.doomed.append(block)
            else:
                self._place(block, seen)
            if self.chains is not None:
                self.chains.add(block)
        self.size += len(blocks)

    def disown(self, block: Block) -> None:
        """Its next release goes to another policy: drop its reuse mark and release tag."""
        self.reused[block.block_id] = False
        self.tag[block.block_id] = -1
        if self.depths is not None:
            self.depths.forget(block)

    def _recall(self, block: Block) -> bool:
        """Whether recomputed content is remembered (a reuse of the class it was evicted in).

        The history remembers several pools of evictions: a prompt's second use often comes
        that late. The ghost lists, a pool each, also tell the subclass where it lost a hit.
        """
        digest = block.digest
        remembered = self.history.pop(digest)
        if remembered is None:
            return False
        self._recalled(remembered)
        for source, ghost in enumerate(self.ghosts):
            if ghost.pop(digest) is not None:
                self._ghost_hit(source)
                break
        return True

    def _recalled(self, remembered: int) -> None:
        """Evicted content is back: a reuse of the class it was released in."""
        self.classes.note_reuse(remembered)

    def _history_value(self, block: Block) -> int:
        """What the history remembers of an evicted block: its release's tag."""
        return self.tag[block.block_id]

    def _ghost_hit(self, source: int) -> None:
        """Content evicted from ``source`` was needed again (subclasses adapt here)."""

    def pop_victim(self) -> Block:
        """The oldest doomed block, else the subclass's choice; always a leaf."""
        block = self._choose()
        if self.chains is not None:
            block = self.chains.leaf_under(block)
        source = self._source(block)
        self._unlink(block)
        self._remember(block, source)
        if self.depths is not None:
            self.depths.forget(block)
        return block

    def _choose(self) -> Block:
        """The oldest doomed block, else the subclass's choice."""
        return self.doomed.head.next_free if self.doomed.size else self._select()

    def _source(self, block: Block) -> int:
        """The ghost list a block evicted from where it is now joins."""
        return FROM_DOOMED if self.where[block.block_id] == DOOMED else FROM_PROBATION

    def _remember(self, block: Block, source: int) -> None:
        """Remember the digest: its class in the history, its part in a ghost list.

        As in ARC, a part and its ghost list together cover at most one pool, so a ghost hit
        names content that part would have kept had it held the whole pool.
        """
        self.history.add(block.digest, self._history_value(block))
        self.tag[block.block_id] = -1
        ghost = self.ghosts[source]
        ghost.capacity = max(1, self.num_blocks - self._part_size(source))
        ghost.add(block.digest)

    def _part_size(self, source: int) -> int:
        return self.doomed.size

    def _select(self) -> Block:
        raise NotImplementedError

    def _place(self, block: Block, seen: bool) -> None:
        raise NotImplementedError

    def _detach(self, block: Block) -> None:
        raise NotImplementedError

    def _held(self) -> Iterator[Block]:
        """Every free block the subclass holds (not the doomed ones)."""
        raise NotImplementedError

    def clear(self) -> list[Block]:
        """Hand back every block and forget everything learned: a fresh policy."""
        blocks = list(self)
        self.__init__(self.num_blocks)
        return blocks

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[Block]:
        yield from self.doomed
        yield from self._held()

    def check(self) -> None:
        for block_id in check_queue(self.doomed, f"{self.name} doomed"):
            require(self.where[block_id] == DOOMED, f"{self.name}: block {block_id} lost")
        listed = sum(1 for _ in self)
        marked = sum(1 for where in self.where if where != NOWHERE)
        require(listed == marked == self.size, f"{self.name}: {marked} marked, {listed} held")
        require(all(len(g) <= g.capacity for g in self.ghosts), f"{self.name}: ghost overflow")
        if self.chains is not None:
            require(len(self.chains) == listed, f"{self.name}: chain index out of step")
