"""Whole-pool invariant checks; each failure names the rule it breaks."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from prefixcache.cache.blocks import check_queue
from prefixcache.cache.common import cdiv, require
from prefixcache.cache.retention import NO_MARK
from prefixcache.cache.sequence import NO_PAGE

if TYPE_CHECKING:
    from prefixcache.cache.blocks import Block
    from prefixcache.cache.manager import KVCacheManager
    from prefixcache.cache.owner_parts import OwnerParts
    from prefixcache.cache.retention import Retention
    from prefixcache.cache.sequence import Sequence
    from prefixcache.cache.window_pages import WindowPages


def check(manager: KVCacheManager) -> None:
    """Verify the free queue, the refcounts, the index and every live table."""
    free_ids = _check_free_queue(manager)
    _check_refcounts(manager, free_ids)
    _check_index(manager)
    _check_duplicates(manager)
    _check_event_counts(manager)
    _check_owners(manager, free_ids)
    _check_retention(manager)
    for seq in manager.sequences.values():
        _check_sequence(manager, seq)
    if manager.windows is not None:
        _check_attachments(manager.windows)
        for seq in manager.sequences.values():
            _check_window_rows(manager.windows, seq)


def _check_free_queue(manager: KVCacheManager) -> set[int]:
    """The free blocks (the empty queue, the eviction policies, retention) are consistent and
    held once each."""
    pool = manager.pool
    free_ids = check_queue(pool.empty_queue, "empty queue")
    for block_id in free_ids:
        block = pool.blocks[block_id]
        require(block.key is None, f"free: cached {block} in the empty queue")
    for policy in pool.parts.policies():
        policy.check()
        for block in policy:
            require(block.block_id not in free_ids, f"free: {block} is held twice")
            require(block.ref_cnt == 0, f"rule 6: {block} is in {policy.name} while in use")
            require(block.key is not None, f"{policy.name}: {block} holds nothing cached")
            free_ids.add(block.block_id)
    for block_id, block in pool.retention.free.items():
        require(block is pool.blocks[block_id], f"retention: {block} is filed under {block_id}")
        require(block_id not in free_ids, f"free: {block} is held twice (once in retention)")
        require(block.ref_cnt == 0, f"rule 6: {block} is in retention while in use")
        require(block.key is not None, f"retention: {block} holds nothing cached")
        free_ids.add(block_id)
    if pool.windows is not None:
        _check_free_pages(pool.windows, free_ids)
    require(
        len(free_ids) == pool.num_free_blocks,
        f"free: {pool.num_free_blocks} counted, {len(free_ids)} held",
    )
    return free_ids


def _check_refcounts(manager: KVCacheManager, free_ids: set[int]) -> None:
    """Each refcount equals the tables holding the block; free + used == total."""
    held = Counter(block.block_id for seq in manager.sequences.values() for block in seq.blocks)
    held.update(
        page.block_id
        for seq in manager.sequences.values()
        for row in seq.window_pages
        for page in row
        if page is not None
    )
    for block in manager.pool.blocks:
        require(
            block.ref_cnt == held[block.block_id],
            f"rule 6: {block} has refcount {block.ref_cnt} but "
            f"{held[block.block_id]} live tables hold it",
        )
        in_use = block.ref_cnt > 0
        require(
            in_use != (block.block_id in free_ids),
            f"rule 5: {block} is {'both free and in a table' if in_use else 'lost'}",
        )
    used = sum(1 for block in manager.pool.blocks if block.ref_cnt > 0)
    require(
        used + len(free_ids) == manager.num_blocks,
        f"counts: {used} used + {len(free_ids)} free != {manager.num_blocks} blocks",
    )


def _check_index(manager: KVCacheManager) -> None:
    """Every mapping points at a block holding that key; every keyed block is mapped."""
    cached = manager.pool.cached
    cached.check()
    for key, block in cached.items():
        require(block.key == key, f"rule 8: stale mapping, key points at {block}")
        require(block.uid != 0 and block.digest is not None, f"rule 8: {block} lost its id")
    uids = [block.uid for block in cached.values()]
    require(len(uids) == len(set(uids)), "rule 8: two indexed blocks share a content id")
    for block in manager.pool.blocks:
        if block.key is not None:
            require(cached.get(block.key) is block, f"rule 8: {block} keyed but unmapped")
        if block.uid == 0:
            require(block.digest is None, f"rule 8: {block} has a digest but no identity")


def _check_duplicates(manager: KVCacheManager) -> None:
    """The registry lists exactly the held key-less copies of indexed content, once each."""
    pool = manager.pool
    indexed = {block.uid for block in pool.cached.values()}
    listed: set[int] = set()
    for uid, copies in pool.duplicates.items():
        require(copies, f"rule 8: an empty duplicate list for uid {uid}")
        require(uid in indexed, f"rule 8: duplicates of uid {uid}, whose content is not indexed")
        for block in copies:
            require(
                block.uid == uid and block.key is None,
                f"rule 8: {block} is listed as a duplicate of uid {uid} but is not one",
            )
            require(block.ref_cnt > 0, f"rule 8: free {block} is still listed as a duplicate")
            require(block.block_id not in listed, f"rule 8: {block} is listed twice")
            listed.add(block.block_id)
    for block in pool.blocks:
        if block.uid and block.key is None:
            require(
                block.block_id in listed,
                f"rule 8: {block} holds an identity but is neither indexed nor a duplicate",
            )


def _check_owners(manager: KVCacheManager, free_ids: set[int]) -> None:
    """A fair pool: each owner's blocks are charged to it, and the counts add up to the pool."""
    pool, owners = manager.pool, manager.owners
    if owners is None:
        return
    parts = pool.parts
    held = parts.held_counts()
    require(len(held) <= len(owners.names), f"owners: {len(held)} counts for {owners.names}")
    if parts.parts is not None:
        _check_owner_parts(parts, sum(held))
    cached = sum(1 for block_id in free_ids if pool.blocks[block_id].key is not None)
    used, empty = manager.num_blocks - len(free_ids), len(free_ids) - cached
    retained = len(pool.retention.free)
    require(
        used + empty + sum(held) + retained == manager.num_blocks,
        f"owners: {used} used + {empty} empty + {sum(held)} held by owners "
        f"+ {retained} retained != {manager.num_blocks} blocks",
    )
    usage = parts.usage()
    suffered = sum(owner.evictions_suffered for owner in usage)
    caused = sum(owner.evictions_caused for owner in usage)
    counted = manager.stats.evictions
    require(
        suffered == caused == counted,
        f"owners: {suffered} evictions suffered, {caused} caused, {counted} counted",
    )
    require(sum(owners.shares) <= 1 + 1e-9, f"owners: shares sum to {sum(owners.shares)}")


def _check_owner_parts(parts: OwnerParts, held: int) -> None:
    """After the split: every block in an owner's policy is charged to that owner."""
    for owner, part in enumerate(parts.parts):
        for block in part:
            charged = parts.holder[block.block_id]
            require(charged == owner, f"owners: owner {owner} holds {block}, charged to {charged}")
    require(held == parts.num_cached_free, f"owners: {held} held, {parts.num_cached_free} counted")


def _check_retention(manager: KVCacheManager) -> None:
    """Marks sit on held or retained blocks, are filed under their owner, stay within each
    owner's budget; every free retained block has a live heap entry."""
    pool = manager.pool
    retention = pool.retention
    marked = {block_id for owned in retention.marks.values() for block_id in owned}
    for block in pool.blocks:
        block_id = block.block_id
        has_mark = retention.expiry[block_id] != NO_MARK
        require(has_mark == (block_id in marked), f"retention: {block}'s mark is not filed")
        if has_mark:
            _check_mark(retention, block)
    for owner, owned in retention.marks.items():
        require(owned, f"retention: an empty mark set for owner {owner!r}")
        for block_id in owned:
            by = retention.marked_by[block_id]
            require(by == owner, f"retention: block {block_id} filed under {owner!r}, by {by!r}")
    now = retention.clock()
    for owner in retention.marks:
        count, budget = retention.unexpired(owner, now), retention.budget(owner)
        require(count <= budget, f"retention: {owner!r} retains {count} > budget {budget}")
    live = {entry[2] for entry in retention.heap if retention.stamp[entry[2]] == entry[1]}
    missing = retention.free.keys() - live
    require(not missing, f"retention: free retained blocks {sorted(missing)} have no heap entry")


def _check_mark(retention: Retention, block: Block) -> None:
    """A marked block is held (a live table) or waits in retention; it holds its content.

    An expired mark on a free retained block is allowed until the next allocation sweeps it.
    """
    block_id = block.block_id
    free = block_id in retention.free
    require(block.ref_cnt > 0 or free, f"retention: free {block} is marked but not retained")
    require(block.uid != 0, f"retention: {block} is marked but holds no content")
    require(retention.klass[block_id] is not None, f"retention: {block} is marked, no class")


def _check_event_counts(manager: KVCacheManager) -> None:
    """While events are reported, the per-digest counts are exactly the index's."""
    removals = manager.removals
    if removals is not None:
        actual = Counter(block.digest for block in manager.pool.cached.values())
        require(removals.counts == actual, "events: indexed digest counts disagree with the index")


def _check_sequence(manager: KVCacheManager, seq: Sequence) -> None:
    """A live table covers its tokens and its stored blocks still hold its content."""
    block_size = manager.block_size
    require(
        len(seq.blocks) == cdiv(seq.num_tokens, block_size),
        f"table: {seq.request_id!r} has {len(seq.blocks)} blocks for {seq.num_tokens} tokens",
    )
    require(
        seq.block_table == [block.block_id for block in seq.blocks],
        f"table: {seq.request_id!r} block_table disagrees with its blocks",
    )
    require(
        seq.num_cached_tokens <= seq.num_computed_tokens <= seq.num_tokens
        and seq.num_cached_tokens % block_size == 0
        and seq.num_cached_tokens <= max(0, seq.num_prompt_tokens - seq.cap_last_token),
        f"rule 10: {seq.request_id!r} cached/computed counts are inconsistent",
    )
    for index in range(seq.num_stored_blocks):
        block = seq.blocks[index]
        require(block.uid != 0, f"rule 8: {block} of {seq.request_id!r} lost its identity")
        if block.key is not None:
            require(
                block.key[1] == seq.block_bytes(index),
                f"rule 8: {block} is indexed under tokens {seq.request_id!r} does not hold",
            )


def _check_free_pages(windows: WindowPages, free_ids: set[int]) -> None:
    """Free window pages wait once each, attached to a block that can still be matched."""
    check_queue(windows.stale, "stale window pages")
    check_queue(windows.kept, "kept window pages")
    kept = {page.block_id for page in windows.kept}
    require(kept == windows.in_kept, "rule 11: the kept set disagrees with the kept queue")
    for page in windows.free_pages():
        require(page.block_id not in free_ids, f"free: window page {page} is held twice")
        require(page.block_id in windows.home, f"rule 11: free window page {page} is detached")
        logical, _ = windows.home[page.block_id]
        require(logical.key is not None, f"rule 11: free {page} serves unmatchable {logical}")
        free_ids.add(page.block_id)


def _check_attachments(windows: WindowPages) -> None:
    """Each attached page is filed both ways; a page holds no identity of its own."""
    for logical_id, pages in windows.attached.items():
        require(any(pages), f"rule 11: block {logical_id} is listed with no window page")
        for group, page in enumerate(pages):
            if page is None:
                continue
            logical, filed = windows.home.get(page.block_id, (None, -1))
            require(
                logical is not None and logical.block_id == logical_id and filed == group,
                f"rule 11: {page} is attached to block {logical_id} but filed elsewhere",
            )
            require(page.uid == 0 and page.key is None, f"rule 11: window {page} has a key")
    counts = [0] * windows.num_groups
    for pages in windows.attached.values():
        for group, page in enumerate(pages):
            counts[group] += page is not None
    require(sum(counts) == len(windows.home), f"rule 11: {len(windows.home)} homes, {counts}")
    require(counts == windows.counts, f"rule 11: {windows.counts} counted, {counts} attached")


def _check_window_rows(windows: WindowPages, seq: Sequence) -> None:
    """A live sequence holds a page of its own block wherever its windows read (rule 11)."""
    for group, (row, table) in enumerate(zip(seq.window_pages, seq.window_tables, strict=True)):
        require(len(row) == len(seq.blocks), f"rule 11: {seq.request_id!r} group {group} row")
        start = windows.needed_from(group, seq.num_computed_tokens)
        for index, page in enumerate(row):
            if page is None:
                require(
                    index < start and table[index] == NO_PAGE,
                    f"rule 11: {seq.request_id!r} lost window group {group}'s block {index} "
                    "while its window reads it",
                )
                continue
            require(table[index] == page.block_id, f"rule 11: {seq.request_id!r} window table")
            logical, _ = windows.home[page.block_id]
            require(
                logical is seq.blocks[index],
                f"rule 11: {page} of {seq.request_id!r} serves {logical}, not its block {index}",
            )
            require(page.ref_cnt > 0, f"rule 6: {seq.request_id!r} holds free window {page}")
