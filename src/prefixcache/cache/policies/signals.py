"""The signals every policy learns from: ghosts, chains, depths and per-class reuse rates."""

from __future__ import annotations

from collections import OrderedDict

from prefixcache.cache.blocks import Block
from prefixcache.cache.hashing import ROOT_UID


class Ghosts:
    """A bounded, insertion-ordered memory of evicted content digests (with a value each)."""

    __slots__ = ("capacity", "entries")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[bytes, int] = OrderedDict()

    def add(self, digest: bytes, value: int = 0) -> None:
        """Remember ``digest`` as the most recent; forget the oldest beyond capacity."""
        entries = self.entries
        entries[digest] = value
        while len(entries) > self.capacity:
            entries.popitem(last=False)

    def pop(self, digest: bytes | None) -> int | None:
        """The remembered value of ``digest`` (forgetting it), or None."""
        return self.entries.pop(digest, None)

    def __len__(self) -> int:
        return len(self.entries)


class ChainIndex:
    """The free blocks a policy holds, grouped by parent uid (``key[0]``).

    ``leaf_under`` lets a policy evict the free blocks below a chosen victim first: the same
    blocks leave, children before their parent, so no cached block is ever an orphan that
    no lookup can reach.
    """

    __slots__ = ("children",)

    def __init__(self) -> None:
        self.children: dict[int, dict[int, Block]] = {}

    def add(self, block: Block) -> None:
        self.children.setdefault(block.key[0], {})[block.block_id] = block

    def remove(self, block: Block) -> None:
        parent = block.key[0]
        siblings = self.children[parent]
        del siblings[block.block_id]
        if not siblings:
            del self.children[parent]

    def leaf_under(self, block: Block) -> Block:
        """``block`` if no free block hangs below it, else its oldest free descendant leaf."""
        children = self.children
        below = children.get(block.uid)
        while below:
            block = next(iter(below.values()))
            below = children.get(block.uid)
        return block

    def __len__(self) -> int:
        return sum(len(siblings) for siblings in self.children.values())


class ChainDepths:
    """Each cached uid's depth in its chain, learned from the blocks a policy is given."""

    __slots__ = ("depth_of",)

    def __init__(self) -> None:
        self.depth_of: dict[int, int] = {}

    def of_release(self, blocks: list[Block]) -> list[int]:
        """Depths of one release (deepest first); a parent unseen so far counts as a chain."""
        depth_of = self.depth_of
        depths = [0] * len(blocks)
        parent_depth = -1
        for position in range(len(blocks) - 1, -1, -1):
            block = blocks[position]
            parent = block.key[0]
            if parent == ROOT_UID:
                depth = 0
            elif position + 1 < len(blocks) and blocks[position + 1].uid == parent:
                depth = parent_depth + 1
            else:
                depth = depth_of.get(parent, len(blocks) - 2 - position) + 1
            depths[position] = depth_of[block.uid] = parent_depth = depth
        return depths

    def forget(self, block: Block) -> None:
        self.depth_of.pop(block.uid, None)


class ReuseClasses:
    """Per class of signals, the share of released blocks referenced again (learned online).

    A class is ``(seen before, last block, depth bucket)``, each feature only if enabled.
    Counts halve every few pools' worth of releases, so the rates follow the traffic; the
    verdicts (``doomed``, ``pace``) are refreshed eight times per half-life.
    """

    DEPTH_EDGES = (1, 4, 16)  # depth buckets: 0, 1-3, 4-15, 16+
    EVIDENCE = 64.0  # releases of a class before its own rate counts (a prior toward the mean)
    DOOMED_SHARE = 1 / 8  # doomed: reused less than this share of the average rate
    DOOMED_EVIDENCE = 256.0  # releases of a class before it may be doomed
    MAX_PACE = 4.0  # a class ages at most this much faster (or slower) than the average
    HALF_LIFE_POOLS = 4
    MIN_HALF_LIFE = 16384  # releases: enough for a rare class to show its rate

    def __init__(self, num_blocks: int, features: frozenset[str]) -> None:
        self.features = features
        self.depth_buckets = len(self.DEPTH_EDGES) + 1 if "depth" in features else 1
        self.count = 4 * self.depth_buckets
        self.released = [0.0] * self.count
        self.reused = [0.0] * self.count
        self.half_life = max(self.HALF_LIFE_POOLS * num_blocks, self.MIN_HALF_LIFE)
        self.until_refresh = self.refresh_every = self.half_life // 8
        self.until_decay = self.half_life
        self.doomed = [False] * self.count
        self.pace = [1.0] * self.count
        self.epoch = 0  # halvings so far: a reuse counts at the weight of its release

    def classify(self, seen: bool, last: bool, depth: int) -> int:
        """The class of a released block."""
        features = self.features
        group = 2 * (seen and "seen" in features) + (last and "last" in features)
        if self.depth_buckets == 1:
            return group
        bucket = sum(1 for edge in self.DEPTH_EDGES if depth >= edge)
        return group * self.depth_buckets + bucket

    def note_release(self, cls: int) -> int:
        """Count a release of ``cls``; the tag its reuse must be reported with."""
        self.released[cls] += 1.0
        self.until_refresh -= 1
        if self.until_refresh <= 0:
            self._refresh()
        return self.epoch << 8 | cls

    def note_reuse(self, tag: int) -> None:
        """A release (by its tag) was referenced again: it counts at its release's weight."""
        self.reused[tag & 0xFF] += 0.5 ** (self.epoch - (tag >> 8))

    def _refresh(self) -> None:
        """Re-decide the verdicts; halve every count once per half-life."""
        self.until_refresh = self.refresh_every
        self.until_decay -= self.refresh_every
        if self.until_decay <= 0:
            self.until_decay = self.half_life
            self.epoch += 1
            self.released = [count / 2 for count in self.released]
            self.reused = [count / 2 for count in self.reused]
        mean = sum(self.reused) / max(1.0, sum(self.released))
        for cls in range(self.count):
            released, reused = self.released[cls], self.reused[cls]
            self.doomed[cls] = (
                self.is_last(cls)
                and released >= self.DOOMED_EVIDENCE
                and reused < self.DOOMED_SHARE * mean * released
            )
            rate = self.rate(cls, mean)
            pace = mean / rate if rate > 0 else self.MAX_PACE
            self.pace[cls] = min(self.MAX_PACE, max(1.0 / self.MAX_PACE, pace))

    def is_last(self, cls: int) -> bool:
        """Whether ``cls`` holds last blocks: the only classes that may be doomed.

        Other rarely reused classes (first-seen documents, say) still hold the one turn in
        five that comes back; they age faster instead (``pace``).
        """
        return "last" in self.features and bool((cls // self.depth_buckets) & 1)

    def rate(self, cls: int, mean: float) -> float:
        """Reuses per release of ``cls``, pulled toward ``mean`` while evidence is thin."""
        return (self.reused[cls] + self.EVIDENCE * mean) / (self.released[cls] + self.EVIDENCE)
