"""KV events from the cache core: exact (a subscriber rebuilds the indexed set) and optional.

A subscriber applies the events to a set of digests (stored adds, removed discards, cleared
empties); after every operation that set must equal the digests of the pool's indexed
blocks. Duplicates are made on purpose (two requests computing one prompt at once, or a
hit below ``min_hit_tokens`` recomputed), so promotion of a held duplicate is exercised.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import admit_computed
from prefixcache import CapacityError, KVCacheManager
from prefixcache.cache.events import (
    MEDIUM_POOL,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
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


class Subscriber:
    """The receiving side: the set of digests the pool can match, rebuilt from events."""

    def __init__(self) -> None:
        self.digests: set[bytes] = set()
        self.events: list[KVEvent] = []

    def __call__(self, event: KVEvent) -> None:
        self.events.append(event)
        if isinstance(event, BlockStored):
            parent = event.parent_block_hash
            assert parent is None or parent in self.digests, "a chain hangs from unknown content"
            self.digests.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            assert set(event.block_hashes) <= self.digests, "removal of unannounced content"
            self.digests.difference_update(event.block_hashes)
        else:
            assert isinstance(event, AllBlocksCleared)
            self.digests.clear()

    def of(self, kind: type) -> list:
        return [event for event in self.events if isinstance(event, kind)]


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


class Twins:
    """One workload on two managers: with a sink (checked) and without (must agree)."""

    def __init__(self, config: tuple, token_ids: bool) -> None:
        block_size, num_blocks, policy, index = config
        self.managers = [
            KVCacheManager(num_blocks, block_size, eviction_policy=policy, index=index)
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
        assert self.managers[1].stats == manager.stats
        for event in self.sub.of(BlockStored):
            assert (event.block_size, event.lora_id, event.medium) == (
                manager.block_size,
                None,
                MEDIUM_POOL,
            )
            if self.token_ids:
                check_chain(manager, event)
            else:
                assert event.token_ids == []


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(map(str, c)))
@settings(max_examples=120, deadline=None)
@given(ops=OPS, token_ids=st.booleans())
def test_events_rebuild_exactly_the_indexed_digests(config, ops, token_ids):
    twins = Twins(config, token_ids)
    for op in ops:
        twins.apply(op)
        twins.check()
    pool = twins.managers[1].pool
    assert "store" not in vars(pool) and "_forget" not in vars(pool), "no sink, no wrappers"


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
