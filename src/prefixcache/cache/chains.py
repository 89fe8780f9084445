"""The pool's blocks by state, and its deepest cached chains: what ``prefixcache top`` shows
of a replica's cache. Counts, digests and depths only, never tokens."""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, NamedTuple

from prefixcache.cache.hashing import ROOT_UID

if TYPE_CHECKING:
    from prefixcache.cache.block_pool import BlockPool
    from prefixcache.cache.blocks import Block

POOL_STATES = ("running", "cached", "retained", "free")


class Chain(NamedTuple):
    """A cached chain that no indexed block extends: its deepest block and depth."""

    digest: bytes  # the deepest block's chained digest (it names the whole prefix)
    blocks: int  # depth from the namespace root
    holders: int  # references on its deepest block now (running sequences holding it)


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


def deepest_chains(pool: BlockPool, limit: int) -> list[Chain]:
    """The ``limit`` deepest chains reachable from the root, deepest first (O(indexed)).

    A chain ends at a block no other indexed block has as parent; blocks whose ancestor was
    evicted are unreachable (no lookup can hit them) and are left out."""
    block_of = {block.uid: block for _, block in pool.cached.items()}
    parent_of = {uid: block.key[0] for uid, block in block_of.items()}
    extended = set(parent_of.values())
    depths: dict[int, int] = {ROOT_UID: 0}
    ends = [(_depth(uid, parent_of, depths), uid) for uid in parent_of if uid not in extended]
    deepest = heapq.nlargest(limit, (end for end in ends if end[0] > 0), key=_by_depth)
    return [_chain(pool, block_of[uid], depth) for depth, uid in deepest]


def _by_depth(end: tuple[int, int]) -> tuple[int, int]:
    """Deepest first; among equals, the oldest content (lowest uid) first."""
    return end[0], -end[1]


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


def _chain(pool: BlockPool, block: Block, depth: int) -> Chain:
    """The chain ending at indexed ``block``: its digest and who holds it (copies too)."""
    copies = pool.duplicates.get(block.uid, ())
    holders = block.ref_cnt + sum(copy.ref_cnt for copy in copies)
    return Chain(block.digest or b"", depth, holders)
