"""The pool by state and where cached chains fork and end (``cache/chains.py``): what
``prefixcache top`` shows of a replica's cache, on a real manager."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import admit_computed
from prefixcache import KVCacheManager
from prefixcache.cache.chains import _depth, pool_states, shared_prefixes

SHARED = list(range(100, 112))  # 3 blocks of 4


def states(manager: KVCacheManager) -> dict[str, int]:
    return pool_states(manager.pool)


def test_states_add_up_and_follow_a_request(make_manager):
    manager = make_manager(16, 4)
    assert states(manager) == {"running": 0, "cached": 0, "retained": 0, "free": 16}
    seq = admit_computed(manager, "a", SHARED + [1, 2, 3, 4, 5])  # 5 blocks, 4 full
    assert states(manager) == {"running": 5, "cached": 0, "retained": 0, "free": 11}
    manager.retain(seq, 8, 60.0)  # the first two blocks
    manager.free(seq)
    assert states(manager) == {"running": 0, "cached": 2, "retained": 2, "free": 12}


def test_forks_come_first_then_the_deepest_ends(make_manager):
    manager = make_manager(32, 4)
    long_prompt = SHARED + list(range(7, 15)) + [0]  # 5 full blocks, then a partial one
    short_prompt = SHARED + list(range(30, 34)) + [0]  # 4 full blocks, forks after 3
    alone = list(range(600, 624))  # 6 full blocks, shared with nothing
    a = admit_computed(manager, "a", long_prompt)
    for rid, prompt in (("b", short_prompt), ("c", alone)):
        manager.free(admit_computed(manager, rid, prompt))
    chains = shared_prefixes(manager.pool, 10)
    assert [(c.blocks, c.branches, c.holders) for c in chains] == [
        (3, 2, 1),  # the shared blocks, where the two prompts part; a holds them
        (6, 0, 0),
        (5, 0, 1),
        (4, 0, 0),
    ]
    digests = [manager.prompt_digests(p, cap_last_token=False) for p in (long_prompt, alone)]
    assert [c.digest for c in chains[:3]] == [digests[0][2], digests[1][5], digests[0][4]]
    assert [c.shared for c in chains] == [True, False, False, False]
    assert shared_prefixes(manager.pool, 2) == chains[:2]
    twin = manager.fork(manager.sequences["a"], "a2")  # two sequences hold the whole chain
    assert [(c.blocks, c.holders) for c in shared_prefixes(manager.pool, 2)] == [(5, 2), (3, 2)]
    manager.free(twin)
    manager.free(a)
    assert [c.holders for c in shared_prefixes(manager.pool, 10)] == [0, 0, 0, 0]


def test_evicting_the_last_block_shortens_its_chain(make_manager):
    manager = make_manager(6, 4)
    first = admit_computed(manager, "a", SHARED + [0])  # 3 full blocks + a partial one
    manager.free(first)  # the partial one is empty again; blocks 3, 2, 1 cached, LRU
    other = admit_computed(manager, "b", list(range(500, 516)))  # 3 empties, evicts block 3
    chains = shared_prefixes(manager.pool, 10)
    assert [(c.blocks, c.branches, c.holders) for c in chains] == [(4, 0, 1), (2, 0, 0)]
    assert chains[1].digest == manager.prompt_digests(SHARED + [0])[1]
    manager.free(other)


def test_blocks_below_an_evicted_ancestor_are_unreachable():
    """A radix index keeps a detached run indexed until its blocks are reused: no depth."""
    parent_of = {1: 0, 2: 1, 3: 2, 5: 4, 6: 5}  # 4 was evicted: 5 and 6 hang below nothing
    depths = {0: 0}
    assert [_depth(uid, parent_of, depths) for uid in (3, 6, 2, 5)] == [3, -1, 2, -1]


@settings(max_examples=60)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 24), st.booleans()),
        min_size=1,
        max_size=25,
    ),
    st.integers(1, 8),
)
def test_hash_and_radix_indexes_list_the_same_chains(steps, limit):
    """Random prompts over a few seeds (they share prefixes, evict, hold and free): both
    indexes list the same forks and ends, shared first, then deepest first, each the digest
    of a block some prompt stored at that depth; the states add up to the pool."""
    managers = [KVCacheManager(24, 4, index=name) for name in ("hash", "radix")]
    held: list[str] = []
    stored: set[tuple[int, bytes]] = set()
    for number, (seed, length, keep) in enumerate(steps):
        prompt = [seed * 7 + i % (seed + 2) for i in range(length)]
        rid = f"r{number}"
        seqs = [m.admit(rid, prompt) for m in managers]
        if any(s is None for s in seqs):
            assert all(s is None for s in seqs)
            continue
        digests = managers[0].prompt_digests(prompt, cap_last_token=False)
        stored.update(enumerate(digests, 1))
        for manager, seq in zip(managers, seqs, strict=True):
            manager.commit(seq, len(prompt))
            if not keep:
                manager.free(seq)
        held += [rid] if keep else []
        if len(held) > 2:
            rid = held.pop(0)
            for manager in managers:
                manager.free(manager.sequences[rid])
        results = [shared_prefixes(m.pool, limit) for m in managers]
        assert results[0] == results[1]
        order = [(not c.shared, -c.blocks) for c in results[0]]
        assert order == sorted(order) and len(order) <= limit
        assert all((c.blocks, c.digest) in stored for c in results[0])
        for manager in managers:
            assert sum(states(manager).values()) == 24
            assert states(manager)["running"] == 24 - manager.num_free_blocks
            manager.check_invariants()
