"""Tenant-fair pools: each owner's free cached blocks apart, victims from the most over share.

While one owner has used the pool it is the plain pool (the article's free queue, or one
policy), running the inherited code: one owner costs nothing. The second owner splits it,
once: the free cached blocks so far become the first owner's part, and from then on each
owner's free cached blocks live in its own policy (``LRUPolicy`` for LRU).
"""

from __future__ import annotations

from collections.abc import Iterable

from prefixcache.cache.block_pool import Block, BlockPool, FreeBlockQueue, PolicyBlockPool
from prefixcache.cache.index import PrefixIndex
from prefixcache.cache.owners import Owners, OwnerUsage, most_over_share
from prefixcache.cache.policies import EvictionPolicy, LRUPolicy, make_owner_policy, make_policy
from prefixcache.cache.stats import CacheStats


class FairPool:
    """The fair behaviour, mixed into ``BlockPool`` or ``PolicyBlockPool`` (see the module).

    A free cached block belongs to the owner whose release dropped its refcount to 0, the
    last user (``holder``). A victim comes from the owner whose free cached blocks most
    exceed its share of all of them (``most_over_share``), in that owner's policy order.
    Blocks holding nothing are reused first, as in every pool.
    """

    free_queue: FreeBlockQueue  # (the pool it is mixed into has these)
    blocks: list[Block]
    stats: CacheStats
    reused: list[int] | None

    def _init_fair(self, owners: Owners, policy_name: str) -> None:
        self.owners = owners
        self.policy_name = policy_name
        self.parts: list[EvictionPolicy] | None = None  # owner id -> its policy, once split
        self.holder = [0] * len(self.blocks)  # owner charged (its allocator while live)
        self.num_cached_free = 0  # blocks in the parts, once split

    @property
    def num_free_blocks(self) -> int:
        if self.parts is None:
            return super().num_free_blocks
        return self.free_queue.size + self.num_cached_free

    # ------------------------------------------------------------ one owner or many
    def allocate(self, count: int, owner: int = 0) -> list[Block]:
        """Take ``count`` blocks for ``owner``: empty ones first, then fair victims."""
        if self.parts is None:
            if owner == 0:
                return super().allocate(count)
            self._split()
        assert count <= self.num_free_blocks, "allocate beyond the free blocks"
        self._part(owner)
        queue, holder = self.free_queue, self.holder
        taken = []
        for _ in range(count):
            block = queue.popleft() if queue.size else self._evict(owner)
            if block.uid:
                self._forget(block)
            block.ref_cnt = 1
            holder[block.block_id] = owner
            taken.append(block)
        self._note_taken(taken)
        return taken

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on each hit; the policy each is charged to hears of it first."""
        parts = self.parts
        if parts is None:
            return super().touch(blocks)
        holder = self.holder
        groups: dict[int, list[Block]] = {}
        for block in blocks:
            groups.setdefault(holder[block.block_id], []).append(block)
        for owner, group in groups.items():
            part = parts[owner]
            held = len(part)
            part.touch(group)
            self.num_cached_free -= held - len(part)
        for block in blocks:
            block.ref_cnt += 1
        return None

    def release(self, blocks: Iterable[Block], owner: int = 0) -> None:
        """Drop a reference each; at 0, cached blocks go to ``owner``'s policy (in order)."""
        if self.parts is None:
            if owner == 0:
                return super().release(blocks)
            self._split()
        cached = []
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.key is not None:
                    cached.append(block)
                else:
                    if block.uid:  # a duplicate
                        self._drop_duplicate(block)
                    self.free_queue.appendleft(block)
        if cached:
            self._charge(cached, owner)
        return None

    def drop_all_cached(self) -> int:
        """Forget every mapping and hand every owner's blocks back to the free queue."""
        for part in self.parts or ():
            for block in part.clear():
                self.free_queue.append(block)
        self.num_cached_free = 0
        return super().drop_all_cached()

    # ------------------------------------------------------------------ many owners
    def _split(self) -> None:
        """A second owner: the free cached blocks so far become owner 0's part (once)."""
        self.parts = [self._single_part()]
        self.num_cached_free = len(self.parts[0])
        self.owners.suffered[0] = self.owners.caused[0] = self.stats.evictions  # all its own

    def _part(self, owner: int) -> EvictionPolicy:
        """Owner ``owner``'s policy, made on its first block."""
        parts = self.parts
        while len(parts) <= owner:
            parts.append(make_owner_policy(self.policy_name, len(self.blocks)))
        return parts[owner]

    def _evict(self, cause: int) -> Block:
        """The next victim: from the owner most over its share, in that owner's order."""
        parts = self.parts
        victim = (
            0 if len(parts) == 1 else most_over_share(list(map(len, parts)), self.owners.shares)
        )
        self.num_cached_free -= 1
        self.owners.count_eviction(victim, cause)
        return parts[victim].pop_victim()

    def _charge(self, blocks: list[Block], owner: int) -> None:
        """Hand freed cached blocks to ``owner`` (the last user pays), taking them from others."""
        part, parts, holder = self._part(owner), self.parts, self.holder
        for block in blocks:
            previous = holder[block.block_id]
            if previous != owner:
                parts[previous].disown(block)
                holder[block.block_id] = owner
        part.insert(blocks)
        self.num_cached_free += len(blocks)

    def would_evict_protected(self, owner: int, count: int, hits: list[Block]) -> bool:
        """Whether taking ``count`` blocks for ``owner`` (after touching ``hits``) would evict
        free cached blocks of another owner that holds no more than its share of the pool.

        It replays the victims ``allocate`` would pick (``most_over_share``) on the counts.
        """
        held = self.held_counts()
        evictions = count - (self.num_free_blocks - sum(held))  # beyond the empty blocks
        for block in hits:  # touched first: they leave their owner's part, unevicted
            if block.ref_cnt == 0:
                held[0 if self.parts is None else self.holder[block.block_id]] -= 1
        shares, pool = self.owners.shares, len(self.blocks)
        for _ in range(max(0, evictions)):
            victim = 0 if self.parts is None else most_over_share(held, shares)
            if victim < 0:
                return False  # nothing left to evict: the allocation cannot happen anyway
            if victim != owner and held[victim] <= shares[victim] * pool:
                return True
            held[victim] -= 1
        return False

    # ---------------------------------------------------------------------- reports
    def held_counts(self) -> list[int]:
        """Free cached blocks per owner id (before the split, all owner 0's)."""
        names = len(self.owners.names)
        counts = [self._single_held()] if self.parts is None else list(map(len, self.parts))
        return (counts + [0] * names)[:names]

    def eviction_counts(self) -> tuple[list[int], list[int]]:
        """Evictions suffered and caused per owner id (before the split, all owner 0's)."""
        owners = self.owners
        if self.parts is not None or not owners.names:
            return list(owners.suffered), list(owners.caused)
        alone = [self.stats.evictions] + [0] * (len(owners.names) - 1)
        return alone, list(alone)

    def usage(self) -> list[OwnerUsage]:
        """Each owner's share, free cached blocks and evictions, in id order (counts only)."""
        owners, held = self.owners, self.held_counts()
        suffered, caused = self.eviction_counts()
        return [
            OwnerUsage(name, owners.shares[owner], held[owner], suffered[owner], caused[owner])
            for owner, name in enumerate(list(owners.names)[: len(held)])
        ]


class FairBlockPool(FairPool, BlockPool):
    """The LRU pool, tenant-fair: while alone, the free queue; then one ``LRUPolicy`` each."""

    def __init__(
        self, num_blocks: int, stats: CacheStats, owners: Owners, index: PrefixIndex | None = None
    ) -> None:
        BlockPool.__init__(self, num_blocks, stats, index)
        self._init_fair(owners, "lru")

    def _single_part(self) -> EvictionPolicy:
        """Owner 0's cached free blocks leave the free queue, in order, for its own queue."""
        part = LRUPolicy(len(self.blocks))
        cached = [block for block in self.free_queue if block.key is not None]
        for block in cached:
            self.free_queue.remove(block)
        part.insert(cached)
        return part

    def _single_held(self) -> int:
        """Free cached blocks, counted over the block list (safe beside the engine thread)."""
        return sum(1 for block in self.blocks if block.ref_cnt == 0 and block.key is not None)


class FairPolicyBlockPool(FairPool, PolicyBlockPool):
    """A policy pool, tenant-fair: while alone, its policy; then one policy per owner."""

    def __init__(
        self,
        num_blocks: int,
        stats: CacheStats,
        owners: Owners,
        policy: EvictionPolicy,
        index: PrefixIndex | None = None,
    ) -> None:
        PolicyBlockPool.__init__(self, num_blocks, stats, policy, index)
        self._init_fair(owners, policy.name)

    def _single_part(self) -> EvictionPolicy:
        return self.policy  # what it learned while alone stays owner 0's

    def _single_held(self) -> int:
        return len(self.policy)


def make_fair_pool(
    num_blocks: int, stats: CacheStats, owners: Owners, policy_name: str, index: PrefixIndex
) -> BlockPool:
    """A fair pool over the LRU free queue or over the policy called ``policy_name``."""
    policy = make_policy(policy_name, num_blocks)
    if policy is None:
        return FairBlockPool(num_blocks, stats, owners, index)
    return FairPolicyBlockPool(num_blocks, stats, owners, policy, index)
