"""Physical block records, the intrusive free queue and the key -> block index."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from prefixcache.cache.events import BlockRemoved
from prefixcache.cache.hashing import ROOT_UID
from prefixcache.cache.index import HashIndex, PrefixIndex
from prefixcache.cache.stats import CacheStats

if TYPE_CHECKING:
    from prefixcache.cache.events import EventSink
    from prefixcache.cache.policies import EvictionPolicy


class Block:
    """One physical KV block: id, refcount, identity once full, free-queue links."""

    __slots__ = ("block_id", "ref_cnt", "key", "uid", "digest", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.key: tuple | None = None  # set only while this block is the indexed copy
        self.uid = 0  # content id of a full, committed block (0: none)
        self.digest: bytes | None = None  # portable chained digest of that content
        self.prev_free: Block | None = None
        self.next_free: Block | None = None

    def __repr__(self) -> str:
        return f"Block(id={self.block_id}, ref={self.ref_cnt}, uid={self.uid})"


class FreeBlockQueue:
    """Doubly linked list threaded through the blocks: O(1) pop, push and unlink.

    The head is the next eviction victim; the tail the most recently freed block.
    """

    __slots__ = ("head", "tail", "size")

    def __init__(self, blocks: list[Block]) -> None:
        self.head = Block(-1)  # sentinels: no None checks on the hot path
        self.tail = Block(-2)
        self.head.next_free = self.tail
        self.tail.prev_free = self.head
        self.size = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> Block:
        """Remove and return the head (the least recently freed block)."""
        block = self.head.next_free
        assert block is not self.tail, "popleft from an empty free queue"
        self.remove(block)
        return block

    def remove(self, block: Block) -> None:
        """Unlink ``block`` from anywhere in the queue."""
        prev, nxt = block.prev_free, block.next_free
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.size -= 1

    def append(self, block: Block) -> None:
        """Put ``block`` at the tail: evicted last."""
        last = self.tail.prev_free
        block.prev_free, block.next_free = last, self.tail
        last.next_free = block
        self.tail.prev_free = block
        self.size += 1

    def appendleft(self, block: Block) -> None:
        """Put ``block`` at the head: reused first (it holds nothing worth keeping)."""
        first = self.head.next_free
        block.prev_free, block.next_free = self.head, first
        first.prev_free = block
        self.head.next_free = block
        self.size += 1

    def __iter__(self) -> Iterator[Block]:
        block = self.head.next_free
        while block is not self.tail:
            yield block
            block = block.next_free

    def __len__(self) -> int:
        return self.size


class BlockPool:
    """All physical blocks, the free queue, and the index of cached content.

    Eviction is lazy: a freed block keeps its key and stays matchable until it is
    popped for reuse; only then is its mapping removed and its identity cleared.

    A block committed with content that is already indexed is a duplicate: same uid and
    digest, no key, listed in ``duplicates`` while it is held. When the indexed copy is
    evicted, a held duplicate is promoted in its place, so content stays matchable while
    any copy of it is live. A freed duplicate drops its identity at once (it can never
    match, and no stale uid survives for a remembered path to trust).
    """

    def __init__(
        self, num_blocks: int, stats: CacheStats, index: PrefixIndex | None = None
    ) -> None:
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: PrefixIndex = HashIndex() if index is None else index
        self.stats = stats
        self._next_uid = ROOT_UID + 1
        self.reused: list[int] | None = None  # ids handed out, when the engine asks to know
        self.duplicates: dict[int, list[Block]] = {}  # uid -> held key-less copies of it
        self.removal_sink: EventSink | None = None
        self.indexed_digests: Counter[bytes] | None = None  # indexed copies, while reporting
        self._reporting = False  # store and _forget are wrapped (report_removals)

    def observe_evictions(self, hook: Callable[[Block], None]) -> None:
        """Call ``hook(block)`` before each eviction clears the block's identity.

        Wraps ``_forget`` on this instance only, so a pool without a hook pays nothing.
        """
        forget = self._forget

        def forget_observed(block: Block) -> None:
            if block.key is not None:
                hook(block)
            forget(block)

        self._forget = forget_observed

    def report_removals(self, sink: EventSink | None) -> None:
        """Send ``BlockRemoved`` to ``sink`` when the last indexed copy of a digest leaves.

        The first sink wraps ``store`` and ``_forget`` on this instance (a pool that never
        reports pays nothing); None stops reporting (the wrappers stay, idle). Digests are
        counted, not uids: an orphan left indexed below an evicted parent has the digest
        its recomputation gets, so one digest can be indexed twice.
        """
        if sink is not None and not self._reporting:
            self._install_reporting()
        self.removal_sink = sink
        self.indexed_digests = None
        if sink is not None:
            self.indexed_digests = Counter(block.digest for block in self.cached.values())

    def _install_reporting(self) -> None:
        """Wrap ``store`` (count new mappings) and ``_forget`` (report the last copy)."""
        store, forget = self.store, self._forget
        self._reporting = True

        def store_counted(block: Block, key: tuple, digest: bytes) -> int:
            uid = store(block, key, digest)
            if block.key is not None and self.indexed_digests is not None:
                self.indexed_digests[digest] += 1
            return uid

        def forget_reported(block: Block) -> None:
            counts, digest = self.indexed_digests, block.digest
            last = block.key is not None and block.uid not in self.duplicates
            forget(block)
            if last and counts is not None:
                counts[digest] -= 1
                if not counts[digest]:
                    del counts[digest]
                    self.removal_sink(BlockRemoved([digest]))

        self.store, self._forget = store_counted, forget_reported

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.size

    def allocate(self, count: int, owner: int = 0) -> list[Block]:
        """Take ``count`` blocks from the head, evicting whatever they cached.

        ``owner`` (an owner id) matters only to a fair pool (``FairBlockPool``).
        """
        assert count <= self.free_queue.size, "allocate beyond the free blocks"
        taken = []
        popleft = self.free_queue.popleft
        for _ in range(count):
            block = popleft()
            if block.uid:
                self._forget(block)
            block.ref_cnt = 1
            taken.append(block)
        self._note_taken(taken)
        return taken

    def _note_taken(self, taken: list[Block]) -> None:
        """After an allocation: the free low watermark, and the reuse log if one is kept."""
        free = self.num_free_blocks
        if free < self.stats.min_free_blocks:
            self.stats.min_free_blocks = free
        if self.reused is not None:
            self.reused.extend([block.block_id for block in taken])

    def _forget(self, block: Block) -> None:
        """Drop the block's mapping (or hand it to a held duplicate) and identity before reuse."""
        if block.key is not None:
            duplicates = self.duplicates
            if duplicates and block.uid in duplicates:
                self._promote(block)
            else:
                del self.cached[block.key]
            block.key = None
            self.stats.evictions += 1
        block.uid = 0
        block.digest = None

    def _promote(self, block: Block) -> None:
        """Make a held duplicate the indexed copy in ``block``'s place: same uid, same key."""
        copies = self.duplicates[block.uid]
        heir = copies.pop()
        if not copies:
            del self.duplicates[block.uid]
        heir.key = block.key
        self.cached.replace(heir)

    def _drop_duplicate(self, block: Block) -> None:
        """A duplicate nobody holds any more: unlist it and clear its identity."""
        copies = self.duplicates[block.uid]
        copies.remove(block)
        if not copies:
            del self.duplicates[block.uid]
        block.uid = 0
        block.digest = None

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on each hit, pulling free ones out of the queue."""
        unlinked = 0
        for block in blocks:
            if block.ref_cnt:
                block.ref_cnt += 1
            else:  # unlink from the queue (inlined: this is the hot path)
                prev, nxt = block.prev_free, block.next_free
                prev.next_free, nxt.prev_free = nxt, prev
                block.prev_free = block.next_free = None
                block.ref_cnt = 1
                unlinked += 1
        self.free_queue.size -= unlinked

    def release(self, blocks: Iterable[Block], owner: int = 0) -> None:
        """Drop one reference each, in the order given; refcount 0 goes to the queue.

        Cached blocks are spliced onto the tail as one run, in the order given (evicted
        last); blocks holding nothing reusable go to the head, to be reused first.
        """
        queue = self.free_queue
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
        for block in empties:
            if block.uid:  # a duplicate
                self._drop_duplicate(block)
            queue.appendleft(block)

    def store(self, block: Block, key: tuple, digest: bytes) -> int:
        """Record held ``block`` as holding ``key``; a duplicate takes the indexed copy's uid."""
        existing = self.cached.get(key)
        if existing is None:
            uid = self._next_uid
            self._next_uid += 1
            block.uid = uid  # before indexing: a radix index files blocks by uid
            self.cached[key] = block
            block.key = key
            self.stats.stored_blocks += 1
        else:
            uid = existing.uid
            self.duplicates.setdefault(uid, []).append(block)
            self.stats.duplicate_blocks += 1
        block.uid = uid
        block.digest = digest
        return uid

    def drop_all_cached(self) -> int:
        """Forget every mapping; only valid while no block is referenced."""
        dropped = len(self.cached)
        for block in self.blocks:
            block.key = None
            block.uid = 0
            block.digest = None
        self.cached.clear()
        self.duplicates.clear()
        if self.indexed_digests is not None:
            self.indexed_digests.clear()
        return dropped


class PolicyBlockPool(BlockPool):
    """A pool whose free cached blocks are ordered by an ``EvictionPolicy`` (not LRU).

    The inherited free queue keeps only blocks holding nothing reusable, reused first as in
    the LRU pool; cached free blocks live in the policy, which picks each victim.
    """

    def __init__(
        self,
        num_blocks: int,
        stats: CacheStats,
        policy: EvictionPolicy,
        index: PrefixIndex | None = None,
    ) -> None:
        super().__init__(num_blocks, stats, index)
        self.policy = policy

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.size + len(self.policy)

    def allocate(self, count: int, owner: int = 0) -> list[Block]:
        """Take ``count`` blocks: empty ones first, then the policy's victims."""
        assert count <= self.num_free_blocks, "allocate beyond the free blocks"
        taken = []
        for _ in range(count):
            queue = self.free_queue
            block = queue.popleft() if queue.size else self.policy.pop_victim()
            if block.uid:
                self._forget(block)
            block.ref_cnt = 1
            taken.append(block)
        self._note_taken(taken)
        return taken

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on each hit; the policy hears of them first (frees its free ones)."""
        self.policy.touch(blocks)
        for block in blocks:
            block.ref_cnt += 1

    def release(self, blocks: Iterable[Block], owner: int = 0) -> None:
        """Drop a reference each; at 0, cached blocks go to the policy (in order), others first."""
        cached = []
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.key is None:
                    if block.uid:  # a duplicate
                        self._drop_duplicate(block)
                    self.free_queue.appendleft(block)
                else:
                    cached.append(block)
        if cached:
            self.policy.insert(cached)

    def drop_all_cached(self) -> int:
        """Forget every mapping and hand the policy's blocks back to the free queue."""
        for block in self.policy.clear():
            self.free_queue.append(block)
        return super().drop_all_cached()
