"""The pool's blocks by state, and where its cached chains fork and end (the longest shared
prefixes): what ``prefixcache top`` shows of a replica's cache. Counts, digests and depths
only, never tokens."""

from __future__ import annotations

import heapq
from collections import Counter
from typing import TYPE_CHECKING, NamedTuple

from prefixcache.cache.hashing import ROOT_UID

if TYPE_CHECKING:
    from prefixcache.cache.block_pool import BlockPool
    from prefixcache.cache.blocks import Block

POOL_STATES = ("running", "cached", "retained", "free")


class Chain(NamedTuple):
    """Where a cached chain forks or ends: its block's digest, depth and use."""

    digest: bytes  # the block's chained digest: it names the whole prefix up to it
    blocks: int  # depth from the namespace root
    branches: int  # indexed blocks extending it (0: the chain ends here)
    holders: int  # references on the block now (running sequences holding it)

    @property
    def shared(self) -> bool:
        """Several continuations were cached after it, or several sequences hold it now."""
        return self.branches > 1 or self.holders > 1


def pool_states(pool: BlockPool) -> dict[str, int]:
    """Blocks by state: held by live requests, free but cached (evictable), free and kept by
    a retention mark, free and holding nothing. They add up to the pool."""
    cached = len(pool.parts) + (0 if pool.windows is None else len(pool.windows))
    return {
        "running": len(pool.blocks) - pool.num_free_blocks,
        "cached": cached,
        "retained": len(pool.retention.free),
        "free": pool.empty_queue.size,
    }


def shared_prefixes(pool: BlockPool, limit: int) -> list[Chain]:
    """Up to ``limit`` forks and ends of the cached chains, the shared ones first (a fork,
    or held by several sequences), deepest first within each (O(indexed blocks)).

    A chain that goes on unforked is one row, at its end; blocks whose ancestor was evicted
    are unreachable (no lookup can hit them) and are left out."""
    block_of = {block.uid: block for _, block in pool.cached.items()}
    parent_of = {uid: block.key[0] for uid, block in block_of.items()}
    children = Counter(parent_of.values())
    depths: dict[int, int] = {ROOT_UID: 0}
    rows = [
        _chain(pool, block_of[uid], depth, children[uid])
        for uid in parent_of
        if children[uid] != 1 and (depth := _depth(uid, parent_of, depths)) > 0
    ]
    return heapq.nsmallest(limit, rows, key=_order)


def _order(chain: Chain) -> tuple[bool, int, int, bytes]:
    """Shared first, then deepest first, then the most branches (then by digest: stable)."""
    return not chain.shared, -chain.blocks, -chain.branches, chain.digest


def _depth(uid: int, parent_of: dict[int, int], depths: dict[int, int]) -> int:
    """Blocks from the root to ``uid`` (-1: unreachable), memoized in ``depths``."""
    path = []
    while uid not in depths:
        path.append(uid)
        parent = parent_of.get(uid)
        if parent is None:  # an evicted ancestor: nothing on the path can be hit
            depths[uid] = -1
            break
        uid = parent
    depth = depths[uid]
    for step in reversed(path):
        depth = -1 if depth < 0 else depth + 1
        depths[step] = depth
    return depth


def _chain(pool: BlockPool, block: Block, depth: int, branches: int) -> Chain:
    """The row of indexed ``block``: its digest and who holds it (held copies too)."""
    copies = pool.duplicates.get(block.uid, ())
    holders = block.ref_cnt + sum(copy.ref_cnt for copy in copies)
    return Chain(block.digest or b"", depth, branches, holders)
