"""Where the pool's free cached blocks wait: one eviction policy, or one per owner (fair).

While one owner has used the pool there is one part, the policy the pool was given: one
owner (or a pool without owners) costs nothing. The second owner splits it, once: the free
cached blocks so far stay the first owner's part, and from then on each owner's free cached
blocks live in its own policy (``EvictionPolicy.fresh``). A free cached block belongs to the
owner whose release dropped its refcount to 0, the last user (``holder``). A victim comes
from the owner whose free cached blocks most exceed its share of all of them
(``most_over_share``), in that owner's policy order.

Free retained blocks (``Retention``) are outside the parts: they count toward no owner's
free cached blocks (``OwnerUsage.cached_blocks``) and so toward no share, and are never a
share's victims. When a mark expires the block joins the part of the owner whose release
freed it; a retained block evicted as a last resort is charged like a victim (suffered by
that owner, caused by the allocating one). Retention budgets bound what each owner can
keep out of the parts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prefixcache.cache.blocks import Block
from prefixcache.cache.owners import Owners, OwnerUsage, most_over_share
from prefixcache.cache.policies import EvictionPolicy
from prefixcache.cache.stats import CacheStats


class OwnerParts:
    """The free cached blocks, in policy order; per owner once a second owner uses the pool.

    ``owners`` None: a pool without tenants, which never splits (every owner id is 0).
    """

    def __init__(
        self, policy: EvictionPolicy, owners: Owners | None, stats: CacheStats, num_blocks: int
    ) -> None:
        self.policy = policy  # owner 0's part: the only one until the split
        self.owners = owners
        self.stats = stats
        self.num_blocks = num_blocks
        self.parts: list[EvictionPolicy] | None = None  # owner id -> its policy, once split
        self.holder = [0] * num_blocks  # owner charged (its allocator while live), once split
        self.num_cached_free = 0  # blocks in the parts, once split

    def __len__(self) -> int:
        return len(self.policy) if self.parts is None else self.num_cached_free

    def policies(self) -> list[EvictionPolicy]:
        """Every policy holding free cached blocks (one until the split)."""
        return [self.policy] if self.parts is None else self.parts

    # ------------------------------------------------------------ the pool's events
    def prepare(self, owner: int) -> None:
        """Before ``owner`` takes or frees blocks: split on a second owner, make its part."""
        parts = self.parts
        if parts is None:
            if not owner:
                return
            parts = self._split()
        while len(parts) <= owner:
            parts.append(self.policy.fresh())

    def taken(self, blocks: list[Block], owner: int) -> None:
        """Blocks just allocated for ``owner``: charged to it while live (once split)."""
        if self.parts is not None:
            holder = self.holder
            for block in blocks:
                holder[block.block_id] = owner

    def acquire(self, blocks: list[Block]) -> None:
        """A reference on each hit, its policy told first (one call while unsplit)."""
        if self.parts is None:
            self.policy.acquire(blocks)
            return
        self.touch(blocks)
        for block in blocks:
            block.ref_cnt += 1

    def release_refs(self, blocks: Iterable[Block], owner: int) -> list[Block]:
        """Drop a reference each; cached ones at 0 become ``owner``'s (in order); returns
        the ones at 0 holding nothing. One call into the policy while one owner is alone."""
        if self.parts is None and not owner:
            return self.policy.release_refs(blocks)
        cached, empties = [], []
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (empties if block.key is None else cached).append(block)
        self.prepare(owner)
        if cached:
            self.insert(cached, owner)
        return empties

    def touch(self, blocks: list[Block]) -> None:
        """Hits, before their refcounts rise: the policy each is charged to hears of it."""
        parts = self.parts
        if parts is None:
            self.policy.touch(blocks)
            return
        holder = self.holder
        groups: dict[int, list[Block]] = {}
        for block in blocks:
            groups.setdefault(holder[block.block_id], []).append(block)
        for owner, group in groups.items():
            part = parts[owner]
            held = len(part)
            part.touch(group)
            self.num_cached_free -= held - len(part)

    def insert(self, blocks: list[Block], owner: int) -> None:
        """Freed cached blocks, in release order: ``owner``'s now (the last user pays)."""
        parts = self.parts
        if parts is None:
            self.policy.insert(blocks)
            return
        holder = self.holder
        for block in blocks:
            previous = holder[block.block_id]
            if previous != owner:
                parts[previous].disown(block)
                holder[block.block_id] = owner
        parts[owner].insert(blocks)
        self.num_cached_free += len(blocks)

    def pop_victim(self, cause: int) -> Block:
        """The next victim: from the owner most over its share, in that owner's order."""
        parts = self.parts
        if parts is None:
            return self.policy.pop_victim()
        victim = 0 if len(parts) == 1 else most_over_share(list(map(len, parts)), self.shares)
        self.num_cached_free -= 1
        self.owners.count_eviction(victim, cause)
        return parts[victim].pop_victim()

    def count_eviction(self, victim: int, cause: int) -> None:
        """An eviction outside the parts (a retained block): charged as ``pop_victim`` does."""
        if self.parts is not None:
            self.owners.count_eviction(victim, cause)

    def clear(self) -> list[Block]:
        """``reset``: every part hands back its blocks (the split, if any, stays)."""
        blocks = [block for part in self.policies() for block in part.clear()]
        self.num_cached_free = 0
        return blocks

    def _split(self) -> list[EvictionPolicy]:
        """A second owner: the free cached blocks so far become owner 0's part (once)."""
        assert self.owners is not None, "an owner id without owners"
        self.parts = [self.policy]
        self.num_cached_free = len(self.policy)
        owners = self.owners
        owners.suffered[0] = owners.caused[0] = self.stats.evictions  # all its own so far
        return self.parts

    @property
    def shares(self) -> list[float]:
        return self.owners.shares

    # ---------------------------------------------------------------------- queries
    def would_evict_protected(
        self, owner: int, evictions: int, hits: list[Block], last_resort: Sequence[int] = ()
    ) -> bool:
        """Whether ``evictions`` victims taken for ``owner`` (after touching ``hits``, none of
        them retained) would include free cached blocks of another owner within its share
        of the pool, or (``last_resort``: the retained blocks' owners, in eviction order)
        another owner's retained block.

        It replays the victims ``pop_victim`` would pick (``most_over_share``) on the counts.
        """
        held = self.held_counts()
        for block in hits:  # touched first: they leave their owner's part, unevicted
            if block.ref_cnt == 0:
                held[0 if self.parts is None else self.holder[block.block_id]] -= 1
        shares, pool = self.shares, self.num_blocks
        from_parts = min(max(0, evictions), sum(held))
        if any(releaser != owner for releaser in last_resort[: max(0, evictions) - from_parts]):
            return True  # the parts run dry: another owner's retained block goes
        for _ in range(from_parts):
            victim = 0 if self.parts is None else most_over_share(held, shares)
            if victim < 0:
                return False  # nothing left to evict: the allocation cannot happen anyway
            if victim != owner and held[victim] <= shares[victim] * pool:
                return True
            held[victim] -= 1
        return False

    def held_counts(self) -> list[int]:
        """Free cached blocks per owner id (before the split, all owner 0's)."""
        names = len(self.owners.names) if self.owners is not None else 1
        counts = list(map(len, self.policies()))
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
        if self.owners is None:
            return []
        owners, held = self.owners, self.held_counts()
        suffered, caused = self.eviction_counts()
        return [
            OwnerUsage(name, owners.shares[owner], held[owner], suffered[owner], caused[owner])
            for owner, name in enumerate(list(owners.names)[: len(held)])
        ]
