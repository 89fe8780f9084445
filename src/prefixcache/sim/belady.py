"""The offline optimum: Belady's MIN over block references, on the replay's own semantics.

**Model.** Request ``t`` needs the set ``R_t`` of its blocks (prefix-chained ids) all at
once; its hits are the leading blocks of ``R_t`` that are cached when it arrives; right
after it, all of ``R_t`` is cached. The pool holds at most ``C`` blocks.

**Why MIN is an upper bound for every policy.** Replaying through ``KVCacheManager`` with
any eviction policy produces cache contents ``S_0, S_1, ...`` with ``|S_t| <= C`` and
``S_t ⊇ R_t`` (orphans and duplicates only waste slots), and request ``t`` hits at most
``|R_t ∩ S_(t-1)|`` blocks (a hit is a cached prefix, so a subset of the cached blocks).
Maximising ``sum |R_t ∩ S_(t-1)|`` over all such sequences is paging with set requests
(the order inside a request does not matter), for which evicting, only when needed and
never a block of the current request, the block whose next request is furthest away is
optimal: Belady's exchange argument goes through with time counted in requests.

**Why it is also achievable (the exact optimum).** Ties are broken deepest block first.
A prefix-chained block's ancestors appear in every request that uses it, so an ancestor
is never needed later than its descendant; with that tie-break MIN never evicts an
ancestor while a descendant stays, its cache stays closed under prefixes, and every
cached block of a request lies in its cached prefix. So MIN's count is reached under
prefix semantics too: ``hit_blocks`` is the optimum, not just a bound.

Cost: one backward pass for next uses, then a heap with lazy deletion; O(n log n) in the
number of block references (the 121,877-reference Mooncake trace takes well under a second).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def next_uses(requests: Sequence[Sequence[int]]) -> list[list[int]]:
    """For each request and position, the index of the next request using that block.

    ``len(requests)`` stands for never.
    """
    never = len(requests)
    last: dict[int, int] = {}
    result: list[list[int]] = [[]] * len(requests)
    for number in range(len(requests) - 1, -1, -1):
        ids = requests[number]
        result[number] = [last.get(block, never) for block in ids]
        for block in ids:
            last[block] = number
    return result


def belady_hits(requests: Sequence[Sequence[int]], capacity: int) -> int:
    """Blocks served from cache under MIN at ``capacity`` (see the module docstring)."""
    if requests and capacity < max(len(ids) for ids in requests):
        raise ValueError(
            f"capacity {capacity} is below the largest request "
            f"({max(len(ids) for ids in requests)} blocks)"
        )
    uses = next_uses(requests)
    cached: dict[int, list] = {}  # block -> its live heap entry [-next use, -depth, block]
    heap: list[list] = []
    hits = 0
    for number, ids in enumerate(requests):
        found = sum(1 for block in ids if block in cached)
        hits += found
        _evict(cached, heap, len(cached) + len(ids) - found - capacity, ids)
        for depth, (block, use) in enumerate(zip(ids, uses[number], strict=True)):
            entry = [-use, -depth, block]
            cached[block] = entry
            heapq.heappush(heap, entry)
        if len(heap) > 2 * len(cached) + 1024:
            heap[:] = list(cached.values())
            heapq.heapify(heap)
    return hits


def _evict(cached: dict[int, list], heap: list[list], count: int, current: Sequence[int]) -> None:
    """Drop ``count`` blocks: furthest next use first, deepest first; never ``current``."""
    if count <= 0:
        return
    keep = set(current)
    spared = []
    while count:
        entry = heapq.heappop(heap)
        block = entry[2]
        if cached.get(block) is not entry:
            continue  # stale: the block was referenced again since
        if block in keep:
            spared.append(entry)
            continue
        del cached[block]
        count -= 1
    for entry in spared:
        heapq.heappush(heap, entry)


def infinite_hits(requests: Sequence[Sequence[int]]) -> int:
    """Blocks that repeat an earlier reference: the hits of an unbounded cache."""
    seen: set[int] = set()
    hits = 0
    for ids in requests:
        hits += sum(1 for block in ids if block in seen)
        seen.update(ids)
    return hits
