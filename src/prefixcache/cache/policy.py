"""Pluggable eviction policies: which free block that still holds cached content goes first.

LRU is not here: it is the pool's own free queue (``BlockPool``), the article's design and
the default, kept exactly as it was. Any other policy runs in a ``PolicyBlockPool``, which
reuses blocks holding nothing first and asks the policy for a victim only when it must
evict. A policy sees four events:

- ``touch(blocks)``: a request references these blocks (cache hits, or a fork), before
  their refcounts rise; the free ones (refcount 0) must leave the policy's structures;
- ``insert(blocks)``: these cached blocks' refcounts dropped to 0, in release order
  (deepest block of a request first, so ties evict descendants before their ancestors);
- ``pop_victim()``: remove and return the block to reuse now;
- ``clear()``: ``reset``; returns every block it held.

Both take a whole request's blocks at once: one call per admission or free, not per
block. Policies that learn from history remember evicted content by its portable digest,
which is the same every time the same content is recomputed (uids are not).
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Iterator

from prefixcache.cache.block_pool import Block, FreeBlockQueue
from prefixcache.cache.common import require
from prefixcache.cache.integrity import check_queue

POLICY_NAMES = ("lru", "arc", "slru", "lfuda")
DEFAULT_POLICY = "lru"  # the article's policy: the free queue itself


class EvictionPolicy:
    """Orders the free cached blocks of one pool (see the module docstring for the events)."""

    name = ""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    def touch(self, blocks: list[Block]) -> None:
        raise NotImplementedError

    def insert(self, blocks: list[Block]) -> None:
        raise NotImplementedError

    def pop_victim(self) -> Block:
        raise NotImplementedError

    def clear(self) -> list[Block]:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def __iter__(self) -> Iterator[Block]:
        raise NotImplementedError

    def check(self) -> None:
        """AssertionError if the policy's own structures are inconsistent."""


class Ghosts:
    """A bounded, insertion-ordered memory of evicted content digests (with a value each)."""

    __slots__ = ("capacity", "entries")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[bytes, int] = OrderedDict()

    def add(self, digest: bytes, value: int = 0) -> None:
        """Remember ``digest`` as the most recent; forget the oldest beyond capacity."""
        self.entries[digest] = value
        if len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def pop(self, digest: bytes | None) -> int | None:
        """The remembered value of ``digest`` (forgetting it), or None."""
        return self.entries.pop(digest, None)

    def __len__(self) -> int:
        return len(self.entries)


class TwoQueuePolicy(EvictionPolicy):
    """Shared machinery of ARC and SLRU: two intrusive queues, one for content seen once.

    ``queue_of[block_id]`` says which queue holds a free block (0 or 1); ``reused`` marks
    blocks referenced again since they were last inserted.
    """

    ghost_factor = 1  # each ghost list remembers this many pools' worth of digests
    frequent_limit = 1 << 62  # the second queue's size cap (only SLRU sets one)

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.queues = (FreeBlockQueue([]), FreeBlockQueue([]))  # (seen once, seen again)
        self.queue_of = [-1] * num_blocks
        self.reused = [False] * num_blocks
        self.ghosts = self._new_ghosts()

    def _new_ghosts(self) -> tuple[Ghosts, Ghosts]:
        capacity = self.ghost_factor * self.num_blocks
        return Ghosts(capacity), Ghosts(capacity)

    def touch(self, blocks: list[Block]) -> None:
        """Hits: mark them reused; free ones leave their queue."""
        reused, queue_of, queues = self.reused, self.queue_of, self.queues
        for block in blocks:
            block_id = block.block_id
            reused[block_id] = True
            if block.ref_cnt == 0:  # unlink (inlined FreeBlockQueue.remove: the hot path)
                prev, nxt = block.prev_free, block.next_free
                prev.next_free, nxt.prev_free = nxt, prev
                block.prev_free = block.next_free = None
                queues[queue_of[block_id]].size -= 1
                queue_of[block_id] = -1

    def insert(self, blocks: list[Block]) -> None:
        """Content referenced again goes to the second queue, the rest where ``_place`` says."""
        reused, queue_of, queues = self.reused, self.queue_of, self.queues
        for block in blocks:
            block_id = block.block_id
            which = 1 if reused[block_id] else self._place(block)
            reused[block_id] = False
            queue_of[block_id] = which
            queue = queues[which]  # append at the tail (inlined FreeBlockQueue.append)
            tail = queue.tail
            last = tail.prev_free
            block.prev_free, block.next_free = last, tail
            last.next_free = tail.prev_free = block
            queue.size += 1
            if which and queue.size > self.frequent_limit:
                self._demote()

    def _place(self, block: Block) -> int:
        """The queue (0 or 1) for a block not referenced again since its last insert."""
        raise NotImplementedError

    def _demote(self) -> None:
        """Move the second queue's oldest block to the tail of the first."""
        block = self.queues[1].popleft()
        self.queues[0].append(block)
        self.queue_of[block.block_id] = 0

    def _pop(self, which: int) -> Block:
        """Evict the head of queue ``which``, remembering its content in that queue's ghost."""
        block = self.queues[which].popleft()
        self.queue_of[block.block_id] = -1
        self.ghosts[which].add(block.digest)
        return block

    def clear(self) -> list[Block]:
        blocks = list(self)
        for queue in self.queues:
            while queue.size:
                self.queue_of[queue.popleft().block_id] = -1
        self.ghosts = self._new_ghosts()
        return blocks

    def __len__(self) -> int:
        return self.queues[0].size + self.queues[1].size

    def __iter__(self) -> Iterator[Block]:
        yield from self.queues[0]
        yield from self.queues[1]

    def check(self) -> None:
        for which, queue in enumerate(self.queues):
            for block_id in check_queue(queue, f"{self.name} queue {which}"):
                require(self.queue_of[block_id] == which, f"{self.name}: block {block_id} lost")
        held = sum(1 for where in self.queue_of if where >= 0)
        require(held == len(self), f"{self.name}: {held} blocks marked, {len(self)} queued")
        require(all(len(g) <= g.capacity for g in self.ghosts), f"{self.name}: ghost overflow")


class ARCPolicy(TwoQueuePolicy):
    """ARC (Megiddo and Modha, FAST'03) over the free cached blocks.

    Content referenced once waits in a recency queue; content referenced again (a hit, or
    recomputed while its digest is still in a ghost list) moves to a frequency queue. Each
    queue remembers the digests it evicted; recomputing one of those moves the target size
    of the recency queue toward the queue that should have kept it. A long run of one-shot
    prompts therefore flushes the recency queue rather than the content that is reused.
    """

    name = "arc"

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.target = 0.0  # ARC's p: the recency queue's target size, in blocks

    def _place(self, block: Block) -> int:
        once, again = self.ghosts
        if once.pop(block.digest) is not None:  # evicted too early from the recency queue
            step = max(1.0, len(again) / max(1, len(once)))
            self.target = min(self.num_blocks, self.target + step)
            return 1
        if again.pop(block.digest) is not None:  # evicted too early from the frequency queue
            step = max(1.0, len(once) / max(1, len(again)))
            self.target = max(0.0, self.target - step)
            return 1
        return 0

    def pop_victim(self) -> Block:
        recent, frequent = self.queues
        if recent.size and (recent.size > self.target or not frequent.size):
            return self._pop(0)
        return self._pop(1)

    def clear(self) -> list[Block]:
        self.target = 0.0
        return super().clear()

    def check(self) -> None:
        super().check()
        require(0.0 <= self.target <= self.num_blocks, f"arc: target {self.target} out of range")


class SLRUPolicy(TwoQueuePolicy):
    """Segmented LRU: a probation queue for new content, a protected one for reused content.

    Content referenced again (a hit, or recomputed while its digest is remembered) is
    protected, up to ``protected_share`` of the pool; the protected queue's oldest block is
    demoted to probation when it overflows. Victims come from probation first. Digests are
    remembered for four pools' worth of evictions: on long traces a prompt's second use
    often comes that late, and without the memory it would start again in probation.
    """

    name = "slru"
    ghost_factor = 4

    def __init__(self, num_blocks: int, protected_share: float = 0.9) -> None:
        super().__init__(num_blocks)
        self.frequent_limit = max(1, int(num_blocks * protected_share))

    def _place(self, block: Block) -> int:
        """Protected if its digest is remembered (recomputed soon after an eviction)."""
        digest = block.digest
        return int(any(ghost.pop(digest) is not None for ghost in self.ghosts))

    def pop_victim(self) -> Block:
        return self._pop(0 if self.queues[0].size else 1)


class LFUDAPolicy(EvictionPolicy):
    """LFU with dynamic aging (Arlitt et al., 2000): evict the lowest ``age + references``.

    ``age`` is the priority of the last victim, so content that was popular long ago ages
    out instead of squatting forever. References are counted per content and survive an
    eviction for a while (by digest). Equal priorities go oldest insert first, which is
    deepest block first within one release.
    """

    name = "lfuda"

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.age = 0
        self.refs = [0] * num_blocks  # references of the content a block holds
        self.entries: list[list | None] = [None] * num_blocks  # live heap entry per block
        self.heap: list[list] = []
        self.size = 0
        self.ghosts = Ghosts(num_blocks)
        self._order = itertools.count()

    def touch(self, blocks: list[Block]) -> None:
        """Count a reference each; free ones leave the heap (lazily)."""
        refs, entries = self.refs, self.entries
        for block in blocks:
            block_id = block.block_id
            refs[block_id] += 1
            if block.ref_cnt == 0:
                entries[block_id][2] = None  # deleted lazily from the heap
                entries[block_id] = None
                self.size -= 1

    def insert(self, blocks: list[Block]) -> None:
        """Queue each at ``age + references``; new content recalls its past references."""
        refs, entries, heap, order = self.refs, self.entries, self.heap, self._order
        for block in blocks:
            block_id = block.block_id
            if refs[block_id] == 0:
                refs[block_id] = (self.ghosts.pop(block.digest) or 0) + 1
            entry = [self.age + refs[block_id], next(order), block]
            entries[block_id] = entry
            heapq.heappush(heap, entry)
        self.size += len(blocks)
        if len(heap) > 2 * self.size + 64:
            heap[:] = [entry for entry in heap if entry[2] is not None]
            heapq.heapify(heap)

    def pop_victim(self) -> Block:
        while True:
            priority, _, block = heapq.heappop(self.heap)
            if block is not None:
                break
        self.age = priority
        self.entries[block.block_id] = None
        self.ghosts.add(block.digest, self.refs[block.block_id])
        self.refs[block.block_id] = 0
        self.size -= 1
        return block

    def clear(self) -> list[Block]:
        blocks = list(self)
        self.heap, self.size, self.age = [], 0, 0
        self.entries = [None] * self.num_blocks
        self.refs = [0] * self.num_blocks
        self.ghosts = Ghosts(self.num_blocks)
        return blocks

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[Block]:
        return (entry[2] for entry in self.heap if entry[2] is not None)

    def check(self) -> None:
        live = [entry for entry in self.heap if entry[2] is not None]
        require(len(live) == self.size, f"lfuda: {len(live)} live entries, size {self.size}")
        for entry in live:
            block = entry[2]
            require(self.entries[block.block_id] is entry, f"lfuda: {block} has a stale entry")


POLICIES: dict[str, type[EvictionPolicy]] = {
    "arc": ARCPolicy,
    "slru": SLRUPolicy,
    "lfuda": LFUDAPolicy,
}


def make_policy(name: str, num_blocks: int) -> EvictionPolicy | None:
    """The policy called ``name`` (None for "lru": the pool's own free queue)."""
    if name == "lru":
        return None
    try:
        return POLICIES[name](num_blocks)
    except KeyError:
        raise ValueError(
            f"unknown eviction_policy {name!r}; choose one of {list(POLICY_NAMES)}"
        ) from None
