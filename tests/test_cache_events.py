"""KV events from the cache core: exact (a subscriber rebuilds the indexed set) and optional.

A subscriber applies the events to a set of (digest, group) pairs (stored adds, removed
discards, cleared empties); after every operation that set must equal what the pool can
match: its indexed blocks in group 0 and, in a hybrid pool, the window pages attached to
them in each window group. Duplicates are made on purpose (two requests computing one
prompt at once, or a hit below ``min_hit_tokens`` recomputed), so promotion of a held
duplicate is exercised.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import admit_computed, pool_holdings
from prefixcache import CapacityError, KVCacheManager
from prefixcache.cache.events import (
    FULL_ATTENTION,
    MEDIUM_POOL,
    SLIDING_WINDOW,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from prefixcache.cache.groups import KVGroupSpec
from prefixcache.cache.hashing import block_digest, encode_tokens, get_hash_function

SHA256 = get_hash_function("sha256")
PROMPTS = [
    [1, 2, 3, 4, 5, 6, 7, 8, 9],
    [1, 2, 3, 4, 5, 6, 70, 80, 90],
    [1, 2, 3, 4, 11],
    [40, 41, 42, 43, 44, 45, 46],
]
RECOMPUTE = 1000  # a min_hit_tokens no hit reaches: the prefix is computed again (duplicates)
KINDS = ["admit"] * 3 + ["commit"] * 4 + ["free"] * 3 + ["append", "fork", "reset"]
# (kind, which prompt or live sequence, how much, tokens): one shape, so lists shrink well
OPS = st.lists(
    st.tuples(
        st.sampled_from(KINDS),
        st.integers(0, 7),
        st.integers(0, 12),
        st.lists(st.integers(0, 2), max_size=4),
    ),
    min_size=20,
    max_size=80,
)
CONFIGS = [
    (block_size, num_blocks, policy, index)
    for block_size, num_blocks in ((2, 10), (4, 6))
    for policy in ("lru", "arc")
    for index in ("hash", "radix")
]
# Hybrid pools: (block size, blocks, policy, index, window sizes of the window groups).
HYBRID_CONFIGS = [
    (2, 20, "lru", "hash", (3,)),
    (4, 14, "arc", "radix", (6,)),
    (2, 24, "lru", "radix", (3, 5)),
]
WINDOW = [KVGroupSpec(1), KVGroupSpec(1, 8)]  # block size 4: a window reads 2 blocks back


class Subscriber:
    """The receiving side: what the pool can match, rebuilt from events (group 0's digests,
    and the window groups' (digest, group_idx) pairs)."""

    def __init__(self) -> None:
        self.digests: set[bytes] = set()
        self.windows: set[tuple[bytes, int]] = set()
        self.events: list[KVEvent] = []

    def __call__(self, event: KVEvent) -> None:
        self.events.append(event)
        if isinstance(event, BlockStored):
            parent = event.parent_block_hash
            assert parent is None or parent in self.digests, "a chain hangs from unknown content"
            if event.group_idx:
                self.windows.update((digest, event.group_idx) for digest in event.block_hashes)
            else:
                self.digests.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            removed = {(digest, event.group_idx) for digest in event.block_hashes}
            assert removed <= self.held, "removal of unannounced content"
            self.digests.difference_update(event.block_hashes if not event.group_idx else ())
            self.windows -= removed
        else:
            assert isinstance(event, AllBlocksCleared)
            self.digests.clear()
            self.windows.clear()

    @property
    def held(self) -> set[tuple[bytes, int]]:
        return {(digest, 0) for digest in self.digests} | self.windows

    def of(self, kind: type, group: int | None = None) -> list:
        return [
            event
            for event in self.events
            if isinstance(event, kind) and (group is None or event.group_idx == group)
        ]


def indexed_digests(manager: KVCacheManager) -> set[bytes]:
    return {block.digest for block in manager.pool.cached.values()}


def check_chain(manager: KVCacheManager, event: BlockStored) -> None:
    """Each digest is the chain step from the one before, over the event's token ids."""
    size = manager.block_size
    assert len(event.token_ids) == size * len(event.block_hashes)
    parent = event.parent_block_hash or manager.root_digest
    for position, digest in enumerate(event.block_hashes):
        chunk = encode_tokens(event.token_ids[position * size : (position + 1) * size])
        assert digest == block_digest(parent, chunk, (), SHA256)
        parent = digest


def check_window_tokens(manager: KVCacheManager, events: list[BlockStored]) -> None:
    """A window group's blocks carry the token ids group 0 announced for their digests (a
    page adopted or promoted is sent alone, without its parent)."""
    size, tokens = manager.block_size, {}
    for event in events:
        if not event.group_idx:
            for position, digest in enumerate(event.block_hashes):
                tokens[digest] = event.token_ids[position * size : (position + 1) * size]
    for event in events:
        if event.group_idx:
            assert len(event.token_ids) == size * len(event.block_hashes)
            chunks = [
                event.token_ids[i * size : (i + 1) * size] for i in range(len(event.block_hashes))
            ]
            assert chunks == [tokens[digest] for digest in event.block_hashes]


class Twins:
    """One workload on two managers: with a sink (checked) and without (must agree)."""

    def __init__(self, config: tuple, token_ids: bool) -> None:
        block_size, num_blocks, policy, index, *windows = config
        groups = [KVGroupSpec(1)] + [KVGroupSpec(1, size) for size in windows[0]] if windows else []
        self.managers = [
            KVCacheManager(
                num_blocks, block_size, eviction_policy=policy, index=index, groups=groups
            )
            for _ in range(2)
        ]
        self.sub = Subscriber()
        self.managers[0].set_event_sink(self.sub, token_ids=token_ids)
        self.token_ids = token_ids
        self.count = 0

    def apply(self, op: tuple) -> None:
        """Run ``op`` on both managers; the results must be identical."""
        self.count += 1
        results = [self._run(manager, op, f"r{self.count}") for manager in self.managers]
        assert results[0] == results[1], op

    def _run(self, m: KVCacheManager, op: tuple, request_id: str) -> object:
        name, which, amount, tokens = op
        if name == "reset":
            return m.reset()
        if name == "admit":
            min_hit = RECOMPUTE if amount < 3 else 0
            try:
                seq = m.admit(request_id, PROMPTS[which % 4] + tokens, min_hit_tokens=min_hit)
            except CapacityError:
                return "too large"
            return seq and (seq.block_table, seq.num_cached_tokens)
        live = list(m.sequences.values())
        if not live:
            return None
        seq = live[which % len(live)]
        if name == "commit":  # often the whole rest, as a prefill chunk would
            upto = seq.num_tokens if amount > 6 else seq.num_computed_tokens + amount
            m.commit(seq, min(seq.num_tokens, upto))
        elif name == "append":
            return m.append(seq, tokens or [0]), m.pop_pending_copies()
        elif name == "fork":
            return m.fork(seq, request_id).block_table
        else:
            m.free(seq)
        return None

    def check(self) -> None:
        manager = self.managers[0]
        manager.check_invariants()
        assert self.sub.digests == indexed_digests(manager)
        assert self.sub.held == pool_holdings(manager)
        assert self.managers[1].stats == manager.stats
        for event in self.sub.of(BlockStored):
            assert (event.block_size, event.lora_id, event.medium) == (
                manager.block_size,
                None,
                MEDIUM_POOL,
            )
            check_group_fields(manager, event)
            if not self.token_ids:
                assert event.token_ids == []
            elif not event.group_idx:
                check_chain(manager, event)
        if self.token_ids:
            check_window_tokens(manager, self.sub.of(BlockStored))


def replayed(config, ops, token_ids: bool) -> Twins:
    """Twins that applied every op, their event replay checked after each."""
    twins = Twins(config, token_ids)
    for op in ops:
        twins.apply(op)
        twins.check()
    return twins


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(map(str, c)))
@settings(max_examples=120, deadline=None)
@given(ops=OPS, token_ids=st.booleans())
def test_events_rebuild_exactly_the_indexed_digests(config, ops, token_ids):
    twins = replayed(config, ops, token_ids)
    pool = twins.managers[1].pool
    assert "store" not in vars(pool) and "_forget" not in vars(pool), "no sink, no wrappers"


def check_group_fields(manager: KVCacheManager, event: BlockStored) -> None:
    """Group 0 is full attention; window group g is ``group_idx`` g + 1 with its window."""
    if not event.group_idx:
        assert (event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window) == (
            FULL_ATTENTION,
            None,
        )
        return
    assert manager.windows is not None and 1 <= event.group_idx <= manager.windows.num_groups
    window = manager.windows.windows[event.group_idx - 1]
    assert (event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window) == (
        SLIDING_WINDOW,
        window,
    )


@pytest.mark.parametrize("config", HYBRID_CONFIGS, ids=lambda c: "-".join(map(str, c)))
@settings(max_examples=120, deadline=None)
@given(ops=OPS, token_ids=st.booleans())
def test_events_rebuild_what_every_group_of_a_hybrid_pool_holds(config, ops, token_ids):
    twins = replayed(config, ops, token_ids)
    assert twins.managers[1].windows.reporter is None  # no sink: the hooks cost one check
    window_events = twins.sub.of(BlockStored, 1) + twins.sub.of(BlockRemoved, 1)
    assert not twins.sub.of(BlockStored) or window_events, "the window groups report too"


def _duplicate_then_evict(m: KVCacheManager) -> tuple:
    """A holds block p0; B holds a duplicate of p0 and its own child q1; A's p0 is evicted."""
    a = m.admit("a", [1, 2, 3, 4, 9])
    b = m.admit("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])  # admitted together: computes p0 again
    m.commit(a, 5)
    m.commit(b, 9)
    assert m.pool.duplicates == {a.blocks[0].uid: [b.blocks[0]]}
    evicted = a.blocks[0]
    m.free(a)
    c = m.admit("c", [50 + i for i in range(12)])  # takes every free block, p0 too
    assert evicted in c.blocks
    return b, c


@pytest.mark.parametrize("index", ["hash", "radix"])
@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_held_duplicate_is_promoted_then_removed_once_its_last_copy_leaves(
    make_manager, policy, index
):
    m = make_manager(6, 4, eviction_policy=policy, index=index)
    sub = Subscriber()
    m.set_event_sink(sub)
    b, c = _duplicate_then_evict(m)
    d0, d1 = b.blocks[0].digest, b.blocks[1].digest
    assert sub.of(BlockRemoved) == []  # p0 is still matchable: B holds it
    assert b.blocks[0].key is not None and m.pool.cached.get(b.blocks[0].key) is b.blocks[0]
    assert m.match(b.token_ids) == 8  # q1 hangs below the promoted p0 (in the radix too)
    assert sub.digests == indexed_digests(m) == {d0, d1}
    m.free(c)
    m.free(b)
    m.free(admit_computed(m, "d", [90 + i for i in range(24)]))  # evicts everything
    removed = [digest for event in sub.of(BlockRemoved) for digest in event.block_hashes]
    assert sorted(removed) == sorted([d0, d1])
    assert sub.digests == indexed_digests(m)


def test_a_freed_duplicate_drops_its_identity_and_is_never_promoted(make_manager):
    m = make_manager(6, 4)
    sub = Subscriber()
    m.set_event_sink(sub)
    a, b = m.admit("a", [1, 2, 3, 4, 9]), m.admit("b", [1, 2, 3, 4, 9])
    m.commit(a, 5)
    m.commit(b, 5)
    copy = b.blocks[0]
    m.free(b)
    assert (copy.uid, copy.digest, m.pool.duplicates) == (0, None, {})
    digest = a.blocks[0].digest
    m.free(a)
    m.free(m.admit("c", [50 + i for i in range(24)]))
    assert sub.of(BlockRemoved) == [BlockRemoved([digest])]
    assert m.match([1, 2, 3, 4, 9]) == 0


def test_a_short_hit_recomputed_is_a_duplicate_and_announces_nothing(make_manager):
    m = make_manager(6, 4)
    sub = Subscriber()
    m.set_event_sink(sub)
    a = admit_computed(m, "a", list(range(9)))
    b = admit_computed(m, "b", list(range(9)), min_hit_tokens=100)
    assert b.num_cached_tokens == 0 and m.stats.duplicate_blocks == 2
    assert len(sub.of(BlockStored)) == 1
    m.free(a)
    m.free(b)


def test_token_ids_appear_only_when_asked(make_manager):
    tokens = list(range(10, 19))
    for token_ids, expected in ((False, []), (True, tokens[:8])):
        m = make_manager(6, 4)
        sub = Subscriber()
        m.set_event_sink(sub, token_ids=token_ids)
        m.free(admit_computed(m, "a", tokens))
        (stored,) = sub.of(BlockStored)
        assert stored.token_ids == expected
        assert stored.block_hashes == [m.pool.blocks[i].digest for i in (0, 1)]


def test_parent_hashes_chain_across_commits_and_sharers(make_manager):
    m = make_manager(8, 4)
    sub = Subscriber()
    m.set_event_sink(sub, token_ids=True)
    tokens = list(range(100, 113))
    parent = m.admit("p", tokens)
    child = m.fork(parent, "c")  # shares every block, none stored yet
    m.commit(parent, 4)
    m.commit(parent, 8)
    m.commit(child, 12)  # blocks 0 and 1 were stored by the sharer: only block 2 is new
    m.commit(parent, 12)  # nothing left to announce
    d0, d1, d2 = parent.full_block_digests()
    assert [(e.parent_block_hash, e.block_hashes) for e in sub.events] == [
        (None, [d0]),
        (d0, [d1]),
        (d1, [d2]),
    ]
    for event in sub.events:
        check_chain(m, event)
    m.free(child)
    m.free(parent)


def test_a_duplicate_prefix_is_left_out_and_the_new_run_hangs_from_it(make_manager):
    m = make_manager(8, 4)
    sub = Subscriber()
    m.set_event_sink(sub)
    a = admit_computed(m, "a", [1, 2, 3, 4, 9])
    b = m.admit("b", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], min_hit_tokens=100)
    m.commit(b, 13)
    assert [(e.parent_block_hash, e.block_hashes) for e in sub.events] == [
        (None, [a.blocks[0].digest]),
        (a.blocks[0].digest, [b.blocks[1].digest, b.blocks[2].digest]),
    ]
    m.free(a)
    m.free(b)


def test_reset_clears_and_a_failed_reset_sends_nothing(make_manager):
    m = make_manager(4, 2)
    sub = Subscriber()
    m.set_event_sink(sub)
    seq = admit_computed(m, "a", [1, 2, 3])
    assert not m.reset()
    assert sub.of(AllBlocksCleared) == []
    m.free(seq)
    assert m.reset()
    assert sub.events[-1] == AllBlocksCleared() and sub.digests == set()


class EvictionLog:
    """A ``CacheObserver`` that only records evictions."""

    def __init__(self) -> None:
        self.evicted_blocks: list[int] = []

    def admitted(self, seq: object, num_hit_blocks: int) -> None: ...

    def freed(self, seq: object) -> None: ...

    def evicted(self, block: object) -> None:
        self.evicted_blocks.append(block.block_id)


def test_a_sink_set_later_knows_content_cached_before_it(make_manager):
    m = make_manager(4, 2)
    log = EvictionLog()
    m.set_observer(log)
    m.free(admit_computed(m, "a", [1, 2, 3]))  # cached with no sink
    digest = m.pool.blocks[0].digest
    sub = Subscriber()
    sub.digests = indexed_digests(m)  # a late subscriber starts from a snapshot
    m.set_event_sink(sub)
    m.set_event_sink(sub)  # setting it again does not wrap twice
    m.free(m.admit("b", [10, 11, 12, 13, 14, 15, 16]))
    assert sub.of(BlockRemoved) == [BlockRemoved([digest])]
    assert log.evicted_blocks == [0]  # the observer still hears of it
    m.set_event_sink(None)
    m.free(admit_computed(m, "c", [1, 2, 3]))
    assert len(sub.events) == 1


def test_without_a_sink_the_cache_behaves_the_same(make_manager):
    def run(m: KVCacheManager) -> list:
        hits, kept = [], None
        for i in range(40):
            tokens = PROMPTS[i % 4] + [i % 3] * (i % 5)
            seq = m.admit(f"r{i}", tokens, min_hit_tokens=RECOMPUTE * (i % 7 == 0))
            hits.append(seq.num_cached_tokens)
            m.commit(seq, seq.num_tokens)
            if kept is not None:
                m.free(kept)
            kept = None if i % 3 else seq
            if kept is None:
                m.free(seq)
        m.free(kept)
        return [hits, m.stats, [(b.key, b.uid) for b in m.pool.blocks]]

    quiet, loud = make_manager(16, 2, index="radix"), make_manager(16, 2, index="radix")
    loud.set_event_sink(Subscriber())
    assert run(quiet) == run(loud)
    assert quiet.stats.duplicate_blocks and quiet.stats.evictions


def test_an_orphan_and_its_recomputation_share_a_digest_and_count_twice(make_manager):
    m = make_manager(6, 2)
    sub = Subscriber()
    m.set_event_sink(sub)
    m.free(admit_computed(m, "a", [1, 2, 3]))
    m.free(admit_computed(m, "b", [1, 2, 7, 8, 9], min_hit_tokens=100))  # [7, 8] under a's [1, 2]
    orphan = next(block for block in m.pool.free_blocks() if block.key and block.key[0] != 0)
    m.free(m.admit("c", list(range(50, 60))))  # evicts [1, 2] (older than its child), not [7, 8]
    assert orphan.key in m.pool.cached and m.match([1, 2, 7, 8, 9]) == 0
    d = admit_computed(m, "d", [1, 2, 7, 8, 9])  # recomputed: the same digests, new uids
    assert d.blocks[1].digest == orphan.digest and d.blocks[1] is not orphan
    first_digest = d.blocks[0].digest
    m.free(d)
    empties = sum(1 for block in m.pool.free_blocks() if block.key is None)
    m.free(m.admit("e", list(range(60, 60 + 2 * empties + 2))))  # evicts only the orphan
    assert orphan.key is None and m.match([1, 2, 7, 8, 9]) == 4
    assert [e.block_hashes for e in sub.of(BlockRemoved)] == [[first_digest]]
    assert sub.digests == indexed_digests(m)


@pytest.mark.parametrize("index", ["hash", "radix"])
@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_remembered_path_never_trusts_a_freed_duplicate(make_manager, policy, index):
    """A promoted block's old slot can become a duplicate of the same content again.

    The path memo trusts a block whose uid is unchanged; freed duplicates therefore drop
    their uid, or a hit would land on a free key-less block (which a policy pool keeps
    outside the policy's queues: touching it corrupts them).
    """
    m = make_manager(4, 4, eviction_policy=policy, index=index)
    prompt = [1, 2, 3, 4]
    a = admit_computed(m, "a", prompt)
    old = a.blocks[0]
    m.free(admit_computed(m, "h", prompt + [5]))  # a hit: the memo remembers [old]
    b = admit_computed(m, "b", prompt, min_hit_tokens=100)  # a held duplicate
    m.free(a)
    filler = m.admit("f", list(range(50, 58)))  # takes both never-used blocks
    c = admit_computed(m, "c", prompt, min_hit_tokens=100)  # evicts old, b is promoted
    assert c.blocks == [old] and old.uid == b.blocks[0].uid and old.key is None
    m.free(c)
    m.free(filler)
    assert old.uid == 0
    e = admit_computed(m, "e", prompt + [5, 6, 7, 8, 9])
    assert e.blocks[0] is b.blocks[0] and e.num_cached_tokens == 4
    m.free(e)
    m.free(b)


# --- window groups ----------------------------------------------------------------------


def window_stored(digests: list[bytes], parent: bytes | None, tokens: list[int]) -> BlockStored:
    """A ``BlockStored`` of ``WINDOW``'s window group (group_idx 1, 8 tokens)."""
    return BlockStored(digests, parent, tokens, 4, None, MEDIUM_POOL, "int8", 1, SLIDING_WINDOW, 8)


def test_a_hybrid_commit_stores_each_group_and_a_released_window_page_stays(make_manager):
    m = make_manager(16, 4, groups=WINDOW)
    sub = Subscriber()
    m.set_event_sink(sub, token_ids=True, kv_cache_dtype="int8")
    seq = admit_computed(m, "a", list(range(13)))
    d = seq.full_block_digests()
    assert sub.events == [
        BlockStored(d, None, list(range(12)), 4, None, MEDIUM_POOL, "int8"),
        window_stored(d, None, list(range(12))),
    ]
    assert seq.window_pages[0][0] is None and m.windows.page(seq.blocks[0], 0) is not None
    m.free(seq)  # every page given back, still attached and matchable: nothing to send
    assert len(sub.events) == 2
    assert sub.held == pool_holdings(m) == {(digest, g) for digest in d for g in (0, 1)}


def test_a_tombstone_removes_its_group_only_and_an_eviction_every_group(make_manager):
    m = make_manager(16, 4, groups=WINDOW)
    sub = Subscriber()
    m.set_event_sink(sub)
    d = admit_computed(m, "a", list(range(13))).full_block_digests()
    m.free(m.sequences["a"])
    assert m.windows.stale.size == 1  # block 0's page left the window mid-prompt
    filler = m.admit("f", list(range(100, 120)))  # 5 blocks, 10 pages: the empty ones
    assert sub.of(BlockRemoved) == []
    tail = m.admit("g", [7])  # a block (the stale page: a tombstone), then a page (a victim)
    assert sub.of(BlockRemoved) == [
        BlockRemoved([d[0]], MEDIUM_POOL, 1),  # block 0 stays cached in the full group
        BlockRemoved([d[2]], MEDIUM_POOL, 0),  # LRU's victim, the deepest block
        BlockRemoved([d[2]], MEDIUM_POOL, 1),  # ... and its window page with it
    ]
    assert sub.held == pool_holdings(m) == {(d[0], 0), (d[1], 0), (d[1], 1)}
    m.free(tail)
    m.free(filler)


def test_an_adopted_window_page_is_announced_alone(make_manager):
    m = make_manager(32, 4, groups=WINDOW)
    sub = Subscriber()
    m.set_event_sink(sub, token_ids=True, kv_cache_dtype="int8")
    tokens = list(range(24))
    d = admit_computed(m, "a", tokens).full_block_digests()
    m.free(m.sequences["a"])
    assert (m.pool.empty_queue.size, m.windows.stale.size) == (20, 4)
    m.free(m.admit("f", list(range(1000, 1048))))  # 24 pages: blocks 0-3 lose theirs
    lost = [e.block_hashes[0] for e in sub.of(BlockRemoved, 1)]
    assert lost == d[:4] and m.match(tokens[:12] + [99]) == 0
    before = len(sub.events)
    m.free(admit_computed(m, "b", tokens[:12] + [99]))  # recomputed: duplicates' pages adopted
    assert m.stats.duplicate_blocks == 3
    assert m.match(tokens[:12] + [99]) == 12
    adopted = [e for e in sub.events[before:] if isinstance(e, BlockStored)]
    assert sorted(adopted, key=lambda e: e.block_hashes) == sorted(
        [window_stored([d[i]], None, tokens[4 * i : 4 * i + 4]) for i in range(3)],
        key=lambda e: e.block_hashes,
    )  # the full group announces nothing: its copies were indexed all along
    assert sub.held == pool_holdings(m)
    check_window_tokens(m, sub.of(BlockStored))


def test_a_promoted_duplicate_announces_the_window_pages_it_holds(make_manager):
    m = make_manager(24, 4, groups=WINDOW)
    sub = Subscriber()
    m.set_event_sink(sub)
    tokens = list(range(13))
    a = admit_computed(m, "a", tokens)
    b = admit_computed(m, "b", tokens, min_hit_tokens=100)  # held duplicates of a's blocks
    d = a.full_block_digests()
    m.free(a)
    filler = m.admit("f", list(range(100, 132)))  # evicts a's blocks 2 and 1 (LRU)
    assert b.blocks[1].key is not None and b.blocks[2].key is not None  # promoted
    for digest in d[1:]:  # a's page went with its block; b's (held) is matchable now
        removed, stored = [e for e in sub.events if e.block_hashes == [digest]][-2:]
        assert removed == BlockRemoved([digest], MEDIUM_POOL, 1)
        assert stored == BlockStored([digest], None, [], 4, kv_cache_dtype=None, group_idx=1,
                                     kv_cache_spec_kind=SLIDING_WINDOW,
                                     kv_cache_spec_sliding_window=8)  # fmt: skip
    assert sub.of(BlockRemoved, 0) == []  # the full group never lost them
    assert sub.held == pool_holdings(m) >= {(digest, g) for digest in d[1:] for g in (0, 1)}
    m.free(filler)
    m.free(b)


def test_a_late_sink_on_a_hybrid_pool_knows_its_pages_and_reset_clears_them(make_manager):
    m = make_manager(16, 4, groups=WINDOW)
    m.free(admit_computed(m, "a", list(range(13))))  # cached with no sink
    sub = Subscriber()
    held = pool_holdings(m)
    sub.digests = {digest for digest, group in held if not group}  # a snapshot, then events
    sub.windows = {pair for pair in held if pair[1]}
    m.set_event_sink(sub)
    m.set_event_sink(sub)  # setting it again does not report twice
    m.free(m.admit("b", list(range(100, 132))))  # 8 blocks, 16 pages: evicts everything
    assert sub.held == pool_holdings(m) == set()
    removed = {(digest, e.group_idx) for e in sub.of(BlockRemoved) for digest in e.block_hashes}
    assert removed == held
    m.free(admit_computed(m, "c", list(range(9))))
    assert m.reset() and sub.events[-1] == AllBlocksCleared() and sub.held == set()
    m.set_event_sink(None)
    assert m.windows.reporter is None
    m.free(admit_computed(m, "d", list(range(9))))
    assert sub.held == set()
