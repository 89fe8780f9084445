"""Tenant-fair caching in the cache core: owners, shares, the victim rule, every policy."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import admit_computed
from prefixcache import KVCacheManager
from prefixcache.cache.block_pool import BlockPool
from prefixcache.cache.owners import MAX_OWNERS, Owners, most_over_share
from prefixcache.cache.policies import POLICY_NAMES
from prefixcache.cache.stats import CacheStats

BLOCK = 16
POOL = 256  # blocks: 4,096 tokens


def flood(manager: KVCacheManager, owner: str, total_tokens: int, seed: int = 1) -> None:
    """Unique 500-token prompts from ``owner`` until ``total_tokens`` have gone through."""
    rng = random.Random(seed)
    sent = 0
    while sent < total_tokens:
        prompt = [rng.randrange(1, 50_000) for _ in range(500)]
        manager.free(admit_computed(manager, f"{owner}-{sent}", prompt, owner=owner))
        sent += len(prompt)


def system_prompt_scenario(manager: KVCacheManager) -> int:
    """A caches a 1,000-token system prompt, B floods 10x the pool; A's next hit (tokens)."""
    system = [random.Random(0).randrange(1, 50_000) for _ in range(1000)]
    manager.free(admit_computed(manager, "a-1", system + [7] * 20, owner="A"))
    flood(manager, "B", 10 * POOL * BLOCK)
    again = admit_computed(manager, "a-2", system + [8] * 20, owner="A")
    manager.free(again)
    return again.num_cached_tokens


# ------------------------------------------------------------------ the scenario
@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_a_flood_cannot_flush_another_owners_prompt_with_fair_cache(make_manager, policy):
    fair = make_manager(POOL, BLOCK, eviction_policy=policy, owner_shares={})
    assert system_prompt_scenario(fair) == 992  # all 62 full blocks of the 1,000 tokens
    usage = {u.name: u for u in fair.owner_usage()}
    assert usage["A"].evictions_suffered == 0
    assert usage["B"].evictions_caused >= 9 * POOL  # B evicted only its own blocks
    assert usage["B"].evictions_suffered == fair.stats.evictions - usage["A"].evictions_suffered


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_without_fair_cache_the_flood_flushes_it(make_manager, policy):
    unfair = make_manager(POOL, BLOCK, eviction_policy=policy)
    assert system_prompt_scenario(unfair) == 0
    assert unfair.owner_usage() == []  # owners are accepted and ignored


def test_an_owner_alone_may_fill_the_whole_pool(make_manager):
    """Work-conserving: A's share of an idle pool is B's to use."""
    manager = make_manager(POOL, BLOCK, owner_shares={"A": 0.9})
    manager.free(admit_computed(manager, "a", [1] * 40, owner="A"))  # A registered, tiny
    flood(manager, "B", 3 * POOL * BLOCK)
    usage = {u.name: u for u in manager.owner_usage()}
    assert usage["B"].cached_blocks >= POOL - 4  # all but A's 2 blocks and one empty one
    assert usage["A"].cached_blocks == 2 and usage["A"].evictions_suffered == 0


def test_shares_bind_under_contention(make_manager):
    """Both flood: each keeps about its share of the cached part of the pool."""
    manager = make_manager(POOL, BLOCK, owner_shares={"A": 0.25, "B": 0.75})
    for round_ in range(20):
        flood(manager, "A", 1000, seed=2 * round_)
        flood(manager, "B", 3000, seed=2 * round_ + 1)
    usage = {u.name: u for u in manager.owner_usage()}
    held = usage["A"].cached_blocks + usage["B"].cached_blocks
    assert abs(usage["A"].cached_blocks / held - 0.25) < 0.05
    assert usage["A"].share == 0.25 and usage["B"].share == 0.75


def test_live_blocks_are_never_evicted_for_fairness(make_manager):
    manager = make_manager(8, 4, owner_shares={})
    held = admit_computed(manager, "a", list(range(1, 25)), owner="A")  # 6 of 8 blocks, live
    assert manager.admit("b", list(range(100, 116)), owner="B") is None  # needs 4: no room
    manager.free(manager.admit("b", list(range(100, 108)), owner="B"))
    assert held.num_computed_tokens == 24 and manager.match(list(range(1, 26))) == 24
    manager.free(held)


# -------------------------------------------------------------- who is charged
def test_a_block_is_charged_to_the_owner_whose_release_freed_it_last(make_manager):
    """Owners sharing a salt share blocks; the last user pays, so counts add up to the pool."""
    manager = make_manager(16, 4, owner_shares={})
    prompt = list(range(1, 18))  # 4 full blocks and a partial one
    manager.free(admit_computed(manager, "a", prompt, owner="A"))
    by_b = admit_computed(manager, "b", prompt, owner="B")  # hits A's 4 blocks
    by_a = admit_computed(manager, "a2", prompt, owner="A")
    manager.free(by_b)  # A still holds them: nothing changes hands
    assert {u.name: u.cached_blocks for u in manager.owner_usage()} == {"A": 0, "B": 0}
    manager.free(by_a)
    assert {u.name: u.cached_blocks for u in manager.owner_usage()} == {"A": 4, "B": 0}
    manager.free(admit_computed(manager, "b2", prompt, owner="B"))
    assert {u.name: u.cached_blocks for u in manager.owner_usage()} == {"A": 0, "B": 4}
    manager.check_invariants()


def test_a_fork_and_copy_on_write_belong_to_the_parents_owner(make_manager):
    manager = make_manager(8, 4, owner_shares={})
    parent = admit_computed(manager, "p", [1, 2, 3, 4, 5, 6], owner="A")
    child = manager.fork(parent, "c")
    assert child.owner == parent.owner
    assert manager.append(child, [9])  # copies the shared partial block, for A
    manager.commit(child, child.num_tokens)
    manager.free(parent)
    manager.free(child)
    assert [(u.name, u.cached_blocks) for u in manager.owner_usage()] == [("A", 1)]


def test_reset_hands_every_owners_blocks_back(make_manager):
    manager = make_manager(16, 4, owner_shares={}, eviction_policy="arc")
    for owner in ("A", "B"):
        manager.free(admit_computed(manager, owner, list(range(1, 14)), owner=owner))
    assert manager.reset()
    assert all(u.cached_blocks == 0 for u in manager.owner_usage())
    assert manager.num_free_blocks == 16 and manager.match(list(range(1, 14))) == 0


# --------------------------------------------------------- one owner: unchanged
def random_requests(count: int, seed: int) -> list[list[int]]:
    """Prompts over a few shared prefixes, so there are hits and evictions."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 99) for _ in range(rng.randrange(4, 30))] for _ in range(6)]
    return [
        rng.choice(prefixes) + [rng.randrange(1, 99) for _ in range(rng.randrange(0, 9))]
        for _ in range(count)
    ]


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_a_fair_pool_with_one_owner_evicts_exactly_as_the_plain_pool(make_manager, policy):
    plain = make_manager(24, 4, eviction_policy=policy)
    fair = make_manager(24, 4, eviction_policy=policy, owner_shares={"solo": 0.5})
    for number, prompt in enumerate(random_requests(300, seed=3)):
        seqs = [admit_computed(m, str(number), prompt, owner="solo") for m in (plain, fair)]
        assert seqs[0].num_cached_tokens == seqs[1].num_cached_tokens, number
        assert seqs[0].block_table == seqs[1].block_table, number
        for manager, seq in zip((plain, fair), seqs, strict=True):
            manager.free(seq)
    assert plain.stats.evictions == fair.stats.evictions > 0


def test_without_shares_the_pool_has_no_owners_and_never_splits(make_manager):
    plain = make_manager(4)
    assert plain.owners is None and plain.pool.parts.owners is None
    assert plain.owner_usage() == []
    fair = make_manager(4, owner_shares={}, eviction_policy="arc")
    assert fair.pool.parts.owners is fair.owners and fair.pool.parts.parts is None
    fair.free(fair.admit("a", [1, 2], owner="A"))
    fair.free(fair.admit("b", [3, 4], owner="B"))
    assert [part.name for part in fair.pool.parts.parts] == ["arc", "arc"]


# ------------------------------------------------------------- the victim rule
def test_most_over_share_picks_the_largest_excess_among_holders():
    assert most_over_share([10, 90], [0.5, 0.5]) == 1
    assert most_over_share([60, 40], [0.5, 0.5]) == 0
    assert most_over_share([30, 70], [0.25, 0.75]) == 0  # 30 - 25 > 70 - 75
    assert most_over_share([0, 5], [0.0, 1.0]) == 1  # only holders can give
    assert most_over_share([5, 5], [0.5, 0.5]) == 0  # ties: the lowest id


OPS = st.lists(
    st.tuples(st.sampled_from(["alloc", "release", "touch"]), st.integers(0, 2), st.integers(1, 3)),
    max_size=60,
)


@given(OPS, st.sampled_from([{}, {"0": 0.6}, {"1": 0.2, "2": 0.2}]))
def test_the_lru_fair_pool_matches_a_model_of_the_rule(ops, listed):
    """Victims: the owner most over its share, its least recently released block first."""
    owners = Owners(listed)
    for name in ("0", "1", "2"):
        owners.id_of(name)
    pool = BlockPool(10, CacheStats(), owners=owners)
    empties = list(range(10))  # the model: empty blocks (head first), and per-owner LRU
    queues: list[list[int]] = [[], [], []]
    held: list[tuple[int, list]] = []  # (owner, blocks) of live groups
    next_key = 0
    for op, owner, count in ops:
        if op == "alloc" and count <= len(empties) + sum(map(len, queues)):
            expected = []
            for _ in range(count):
                if empties:
                    expected.append(empties.pop(0))
                else:
                    victim = most_over_share([len(q) for q in queues], owners.shares)
                    expected.append(queues[victim].pop(0))
            blocks = pool.allocate(count, owner)
            assert [b.block_id for b in blocks] == expected
            for block in blocks:
                next_key += 1
                pool.store(block, (0, next_key.to_bytes(4, "little")), bytes(32))
            held.append((owner, blocks))
        elif op == "release" and held:
            _, blocks = held.pop(min(count, len(held)) - 1)
            pool.release(blocks, owner)
            queues[owner].extend(b.block_id for b in blocks)
        elif op == "touch":
            free = [b for q in queues for b in q][:count]
            blocks = [pool.blocks[b] for b in free]
            pool.touch(blocks)
            for q in queues:
                q[:] = [b for b in q if b not in free]
            held.append((owner, blocks))
        assert pool.num_free_blocks == len(empties) + sum(map(len, queues))
        assert pool.parts.held_counts() == [len(q) for q in queues]


# ------------------------------------------------------------------ the owners
def test_unlisted_owners_share_the_rest_equally():
    owners = Owners({"acme": 0.5})
    for name in ("acme", "b", "c", None):
        owners.id_of(name)
    assert owners.shares == [0.5, 0.5 / 3, 0.5 / 3, 0.5 / 3]
    assert Owners({}).listed == {}


@pytest.mark.parametrize(
    ("shares", "message"),
    [
        ({"a": 0}, r"cache share of 'a' must be a number in \(0, 1\], got 0"),
        ({"a": 1.5}, r"cache share of 'a' must be a number in \(0, 1\], got 1.5"),
        ({"a": "half"}, r"cache share of 'a' must be a number in \(0, 1\], got 'half'"),
        ({"a": True}, r"cache share of 'a' must be a number"),
        ({"a": 0.6, "b": 0.6}, r"cache shares sum to 1.2; at most 1"),
        ({1: 0.5}, r"owner names are strings, got 1"),
        ([("a", 0.5)], r"owner_shares must be a dict"),
    ],
)
def test_bad_shares_are_value_errors_naming_the_owner_and_the_limit(shares, message):
    with pytest.raises(ValueError, match=message):
        KVCacheManager(4, owner_shares=shares)


def test_an_owner_must_be_a_string_and_their_number_is_bounded(make_manager):
    manager = make_manager(4, 4, owner_shares={})
    with pytest.raises(ValueError, match="owner must be a string or None, got int"):
        manager.admit("x", [1, 2], owner=7)
    owners = Owners({})
    for number in range(MAX_OWNERS):
        owners.id_of(str(number))
    with pytest.raises(ValueError, match=f"at most {MAX_OWNERS}"):
        owners.id_of("one too many")
