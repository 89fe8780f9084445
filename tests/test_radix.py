"""The radix-tree index: its structure, and identical behaviour to the hash index."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from conftest import REAL_TRACE
from prefixcache import CapacityError, KVCacheManager
from prefixcache.cache.blocks import Block
from prefixcache.cache.hashing import ROOT_UID
from prefixcache.cache.index import HashIndex, make_index
from prefixcache.cache.policies import POLICY_NAMES
from prefixcache.cache.radix import RadixIndex
from prefixcache.sim.replay import replay
from prefixcache.sim.traces import load_trace


def token(value: int) -> bytes:
    return struct.pack("<I", value)


class Blocks:
    """Fake indexed blocks (block size 1) filed into one or more indexes at once."""

    def __init__(self, *indexes) -> None:
        self.indexes = indexes
        self.next_uid = ROOT_UID + 1

    def add(self, parent: int, value: int) -> Block:
        block = Block(self.next_uid)
        block.uid, block.key = self.next_uid, (parent, token(value))
        self.next_uid += 1
        for index in self.indexes:
            assert index.get(block.key) is None
            index[block.key] = block
        return block

    def chain(self, parent: int, *values: int) -> list[Block]:
        blocks = []
        for value in values:
            blocks.append(self.add(parent, value))
            parent = blocks[-1].uid
        return blocks


def walk(index, values: list[int]) -> list[Block]:
    return index.walk(b"".join(map(token, values)), len(values), {}).blocks


def runs(node) -> list:
    """The tree as nested (block ids of the run, [children...]) for easy comparison."""
    ids = [block.block_id for block in node.blocks]
    return [ids, sorted(runs(child) for child in node.children.values())]


def test_runs_extend_then_split_when_a_branch_is_inserted():
    index = RadixIndex(1)
    blocks = Blocks(index)
    a, b, c = blocks.chain(ROOT_UID, 1, 2, 3)
    assert runs(index.root) == [[], [[[a.uid, b.uid, c.uid], []]]]
    d = blocks.add(b.uid, 4)
    assert runs(index.root) == [[], [[[a.uid, b.uid], [[[c.uid], []], [[d.uid], []]]]]]
    assert walk(index, [1, 2, 4, 9]) == [a, b, d]  # longest prefix
    assert walk(index, [1, 2, 3]) == [a, b, c]
    assert walk(index, [2]) == []
    index.check()


def test_removing_a_middle_block_detaches_what_hangs_below_like_orphaned_keys():
    radix, table = RadixIndex(1), HashIndex(1)
    blocks = Blocks(radix, table)
    a, b, c = blocks.chain(ROOT_UID, 1, 2, 3)
    d = blocks.add(b.uid, 4)
    for index in (radix, table):
        del index[b.key]
    radix.check()
    assert walk(radix, [1, 2, 3]) == walk(table, [1, 2, 3]) == [a]
    for block in (a, c, d):  # still indexed, unreachable below the cut
        assert radix.get(block.key) is table.get(block.key) is block
    assert radix.get(b.key) is None and len(radix) == len(table) == 3
    for index in (radix, table):
        del index[c.key]
        del index[a.key]
    radix.check()
    assert dict(radix.items()) == dict(table.items()) == {d.key: d}
    with pytest.raises(KeyError):
        del radix[a.key]


def test_a_child_of_an_unindexed_parent_is_unreachable_from_the_start():
    radix = RadixIndex(1)
    (orphan,) = Blocks(radix).chain(12345, 7)
    radix.check()
    assert radix.get(orphan.key) is orphan and walk(radix, [7]) == []


def test_unknown_index_is_a_value_error_listing_the_choices():
    with pytest.raises(
        ValueError, match=r"unknown index 'trie'; choose one of \['hash', 'radix'\]"
    ):
        make_index("trie", 16)
    with pytest.raises(ValueError, match="unknown index"):
        KVCacheManager(4, index="trie")


class IndexDifferential(RuleBasedStateMachine):
    """Random inserts and removals on both indexes; every lookup must agree."""

    def __init__(self) -> None:
        super().__init__()
        self.radix, self.table = RadixIndex(1), HashIndex(1)
        self.blocks = Blocks(self.radix, self.table)
        self.parents = [ROOT_UID]  # uids ever indexed (removed ones too: orphans)
        self.keys: list[tuple] = []

    @rule(data=st.data(), value=st.integers(0, 3))
    def insert(self, data, value):
        parent = data.draw(st.sampled_from(self.parents))
        if self.table.get((parent, token(value))) is None:
            block = self.blocks.add(parent, value)
            self.parents.append(block.uid)
            self.keys.append(block.key)

    @precondition(lambda self: self.table)
    @rule(data=st.data())
    def remove(self, data):
        key = data.draw(st.sampled_from(sorted(self.table, key=repr)))
        del self.table[key]
        del self.radix[key]

    @invariant()
    def lookups_agree(self):
        self.radix.check()
        assert len(self.radix) == len(self.table)
        for key in self.keys:
            assert self.radix.get(key) is self.table.get(key)
            assert (key in self.radix) == (key in self.table)

    @invariant()
    def walks_agree(self):
        for first in range(4):
            for second in range(4):
                values = [first, second, 0, 1, 2, 3]
                assert walk(self.radix, values) == walk(self.table, values)


TestIndexDifferential = IndexDifferential.TestCase
TestIndexDifferential.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)

BASES = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 70, 80], [1, 2, 3, 4], [40, 41, 42]]
STEP = st.tuples(
    st.sampled_from(["admit", "admit", "admit", "commit", "append", "fork", "free", "free"]),
    st.integers(0, 99),
    st.lists(st.integers(0, 3), max_size=6),
    st.sampled_from([None, "tenant"]),
)


@settings(max_examples=120, deadline=None)
@given(st.sampled_from(POLICY_NAMES), st.integers(1, 3), st.lists(STEP, max_size=60))
def test_hash_and_radix_managers_behave_identically(policy, block_size, steps):
    pair = [
        KVCacheManager(7, block_size, eviction_policy=policy, index=name)
        for name in ("hash", "radix")
    ]
    live: list[str] = []
    for number, (op, pick, tail, salt) in enumerate(steps):
        outcomes = [apply(m, op, pick, tail, salt, live, f"r{number}") for m in pair]
        assert outcomes[0] == outcomes[1], (op, outcomes)
        if outcomes[0][0] == "new":
            live.append(f"r{number}")
        elif op == "free" and live:
            live.remove(outcomes[0][1])
        for manager in pair:
            manager.check_invariants()
    assert pair[0].stats == pair[1].stats


def apply(manager: KVCacheManager, op, pick, tail, salt, live, new_id) -> tuple:
    """One step; what it observed (identical for both indexes if they agree)."""
    tokens = BASES[pick % len(BASES)] + tail
    if op == "admit" or not live:
        try:
            seq = manager.admit(new_id, tokens, cache_salt=salt)
        except CapacityError:
            return ("too big",)
        if seq is None:
            return ("full",)
        return ("new", seq.num_cached_tokens, list(seq.block_table), manager.match(tokens))
    seq = manager.sequences[live[pick % len(live)]]
    if op == "commit":
        manager.commit(seq, seq.num_tokens)
        return ("commit", manager.match(seq.token_ids))
    if op == "append":
        return ("append", manager.append(seq, tail or [0]), list(seq.block_table))
    if op == "fork":
        child = manager.fork(seq, new_id)
        return ("new", child.num_cached_tokens, list(child.block_table), None)
    manager.free(seq)
    return ("free", seq.request_id)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_identical_hits_on_the_real_trace(policy):
    trace = load_trace(REAL_TRACE)
    hashed = replay(trace, 2000, policy, "hash")
    radix = replay(trace, 2000, policy, "radix")
    assert radix.hits_per_request == hashed.hits_per_request
    assert (radix.evictions, radix.peak_cached_blocks) == (
        hashed.evictions,
        hashed.peak_cached_blocks,
    )
