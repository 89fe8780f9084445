"""The block pool: every physical block, the empty queue, the free cached blocks, the index."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prefixcache.cache.blocks import Block, FreeBlockQueue
from prefixcache.cache.hashing import ROOT_UID
from prefixcache.cache.index import HashIndex, PrefixIndex
from prefixcache.cache.owner_parts import OwnerParts
from prefixcache.cache.owners import Owners
from prefixcache.cache.policies import EvictionPolicy, LRUPolicy
from prefixcache.cache.retention import Retention
from prefixcache.cache.stats import CacheStats
from prefixcache.cache.window_pages import WindowPages

BlockListener = Callable[[Block], None]


class BlockPool:
    """All physical blocks; the free ones wait empty (reused first) or cached (evictable).

    Composed, not subclassed: the free cached blocks live in ``parts`` (an injected
    ``EvictionPolicy``, LRU by default; one per owner once a second owner uses a pool that
    has ``owners``), and whoever wants to hear of the index changing adds itself to a
    listener list. Eviction is lazy: a freed block keeps its key and stays matchable until it
    is popped for reuse; only then is its mapping removed and its identity cleared.

    A block committed with content that is already indexed is a duplicate: same uid and
    digest, no key, listed in ``duplicates`` while it is held. When the indexed copy is
    evicted, a held duplicate is promoted in its place, so content stays matchable while
    any copy of it is live. A freed duplicate drops its identity at once (it can never
    match, and no stale uid survives for a remembered path to trust).

    Free cached blocks a client retained (``retention``) wait outside the policy until
    their marks expire; they are evicted, earliest expiry first, only when nothing else is
    free. Every hot path pays one attribute check while no block is retained.
    """

    def __init__(
        self,
        num_blocks: int,
        stats: CacheStats,
        policy: EvictionPolicy | None = None,
        index: PrefixIndex | None = None,
        owners: Owners | None = None,
        retention: Retention | None = None,
    ) -> None:
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.empty_queue = FreeBlockQueue(self.blocks)  # free blocks holding nothing
        policy = LRUPolicy(num_blocks) if policy is None else policy
        self.parts = OwnerParts(policy, owners, stats, num_blocks)
        self.cached: PrefixIndex = HashIndex() if index is None else index
        self.stats = stats
        self.retention = Retention(num_blocks, stats) if retention is None else retention
        self._next_uid = ROOT_UID + 1
        self.reused: list[int] | None = None  # ids handed out, when the engine asks to know
        self.duplicates: dict[int, list[Block]] = {}  # uid -> held key-less copies of it
        self.on_index: list[BlockListener] = []  # new content mapped (after ``store``)
        self.on_evict: list[BlockListener] = []  # an indexed block, before it loses its key
        self.on_clear: list[Callable[[], None]] = []  # every mapping dropped
        self.windows: WindowPages | None = None  # window groups' pages (a hybrid model)

    @property
    def policy(self) -> EvictionPolicy:
        """The eviction policy (owner 0's, in a pool split between owners)."""
        return self.parts.policy

    @property
    def num_free_blocks(self) -> int:
        free = self.empty_queue.size + len(self.parts) + len(self.retention.free)
        return free if self.windows is None else free + len(self.windows)

    def free_blocks(self) -> Iterator[Block]:
        """Every free block: the empty ones in reuse order, each part's in its order, then
        the retained ones."""
        yield from self.empty_queue
        for policy in self.parts.policies():
            yield from policy
        yield from self.retention.free.values()
        if self.windows is not None:
            yield from self.windows.free_pages()

    def allocate(self, count: int, owner: int = 0) -> list[Block]:
        """Take ``count`` blocks for ``owner``: empty ones first, then stale window pages, the
        policy's victims, kept window pages and (only if those run out) retained blocks,
        earliest expiry first."""
        assert count <= self.num_free_blocks, "allocate beyond the free blocks"
        if self.retention.free:
            self._make_room(count, owner)
        parts, queue = self.parts, self.empty_queue
        parts.prepare(owner)
        taken = []
        windows = self.windows
        for _ in range(count):
            if queue.size:
                block = queue.popleft()
            elif windows is not None and (windows.stale.size or not len(parts)):
                block = windows.pop(windows.stale if windows.stale.size else windows.kept)
            else:
                block = parts.pop_victim(owner)
            if block.uid:
                self._forget(block)
            block.ref_cnt = 1
            taken.append(block)
        parts.taken(taken, owner)
        self._note_taken(taken)
        return taken

    def _note_taken(self, taken: list[Block]) -> None:
        """After an allocation: the free low watermark, and the reuse log if one is kept."""
        free = self.num_free_blocks
        if free < self.stats.min_free_blocks:
            self.stats.min_free_blocks = free
        if self.reused is not None:
            self.reused.extend([block.block_id for block in taken])

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on each hit; the policy hears of them first (frees its free ones).

        Free retained hits leave ``retention`` instead: the policy never held them."""
        if not self.retention.free:
            self.parts.acquire(blocks)  # one pass in the LRU policy: the hot path
            return
        self.parts.touch(self.retention.claim(blocks))
        for block in blocks:
            block.ref_cnt += 1

    def release(self, blocks: Iterable[Block], owner: int = 0) -> None:
        """Drop a reference each; at 0, cached blocks go to ``owner``'s policy (in the order
        given) or, while their marks last, to retention; blocks holding nothing reusable go
        to the head of the empty queue."""
        if self.retention.marks:
            empties = self._release_marked(blocks, owner)
        else:  # one pass in the LRU policy while one owner is alone: the hot path
            empties = self.parts.release_refs(blocks, owner)
        for block in empties:
            if block.uid:  # a duplicate
                self._drop_duplicate(block)
            self.empty_queue.appendleft(block)

    def _release_marked(self, blocks: Iterable[Block], owner: int) -> list[Block]:
        """``release`` while marks exist: unexpired marked blocks wait in retention, the
        other cached ones go to ``owner``'s policy; returns the ones holding nothing."""
        cached, empties = [], []
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (empties if block.key is None else cached).append(block)
        cached = self.retention.hold(cached, empties, owner)
        self.parts.prepare(owner)
        if cached:
            self.parts.insert(cached, owner)
        return empties

    def store(self, block: Block, key: tuple, digest: bytes) -> int:
        """Record held ``block`` as holding ``key``; a duplicate takes the indexed copy's uid."""
        existing = self.cached.get(key)
        if existing is None:
            uid = self._next_uid
            self._next_uid += 1
            block.uid = uid  # before indexing: a radix index files blocks by uid
            block.digest = digest
            self.cached[key] = block
            block.key = key
            self.stats.stored_blocks += 1
            for listener in self.on_index:
                listener(block)
            return uid
        uid = existing.uid
        self.duplicates.setdefault(uid, []).append(block)
        self.stats.duplicate_blocks += 1
        block.uid = uid
        block.digest = digest
        return uid

    def drop_all_cached(self) -> int:
        """Forget every mapping; only valid while no block is referenced."""
        pages = [] if self.windows is None else self.windows.clear()
        for block in self.parts.clear() + self.retention.clear() + pages:
            self.empty_queue.append(block)
        dropped = len(self.cached)
        for block in self.blocks:
            block.key = None
            block.uid = 0
            block.digest = None
        self.cached.clear()
        self.duplicates.clear()
        for listener in self.on_clear:
            listener()
        return dropped

    # ------------------------------------------------------------------- retention
    def sweep_expired(self) -> None:
        """Free retained blocks whose marks expired go to their owner's policy, as if
        released now (each to the owner whose release freed it)."""
        groups: dict[int, list[Block]] = {}
        releaser = self.retention.releaser
        for block in self.retention.pop_expired():
            groups.setdefault(releaser[block.block_id], []).append(block)
        for owner, blocks in groups.items():
            self.parts.prepare(owner)
            self.parts.insert(blocks, owner)

    def _make_room(self, count: int, owner: int) -> None:
        """Before taking ``count`` blocks for ``owner``: sweep expired marks, then evict
        retained blocks, earliest expiry first, for what empties and the policy lack."""
        self.sweep_expired()
        parts, retention = self.parts, self.retention
        short = count - self.empty_queue.size - len(parts)
        if self.windows is not None:
            short -= len(self.windows)
        if short <= 0:
            return
        parts.prepare(owner)
        for _ in range(short):
            block = retention.pop_earliest()
            self._forget(block)
            parts.count_eviction(retention.releaser[block.block_id], owner)
            self.empty_queue.appendleft(block)

    # -------------------------------------------------------------------- identity
    def _forget(self, block: Block) -> None:
        """Drop the block's mapping (or hand it to a held duplicate) and identity before reuse."""
        if block.key is not None:
            for listener in self.on_evict:
                listener(block)
            if self.windows is not None:
                for page in self.windows.drop_all(block):
                    self.empty_queue.appendleft(page)
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
        if self.windows is not None and self.windows.reporter is not None:
            self.windows.reporter.promoted(heir)  # its held pages are matchable now

    def _drop_duplicate(self, block: Block) -> None:
        """A duplicate nobody holds any more: unlist it and clear its identity."""
        copies = self.duplicates[block.uid]
        copies.remove(block)
        if not copies:
            del self.duplicates[block.uid]
        block.uid = 0
        block.digest = None
