"""Every routing policy on hand-made candidates and digests, with hand-computed choices."""

from __future__ import annotations

import hashlib
from collections import Counter

import pytest

from prefixcache.router.index import Overlap
from prefixcache.router.policy import (
    POLICY_NAMES,
    CacheAware,
    CacheAwareWeights,
    Candidate,
    LeastLoaded,
    PrefixHash,
    RoundRobin,
    make_policy,
)
from prefixcache.router.ring import HashRing

A, B, C = "http://a", "http://b", "http://c"


def chain(name: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{name}/{i}".encode()).digest() for i in range(n)]


def test_round_robin_takes_each_replica_in_turn() -> None:
    policy = RoundRobin()
    candidates = [Candidate(A, load=9), Candidate(B), Candidate(C)]
    assert [policy.choose([], candidates).url for _ in range(6)] == [A, B, C, A, B, C]
    assert {policy.choose([], candidates[:2]).url for _ in range(2)} == {A, B}


def test_least_loaded_picks_the_lowest_load_and_rotates_ties() -> None:
    assert LeastLoaded().choose([], [Candidate(A, 3), Candidate(B, 1), Candidate(C, 2)]).url == B
    policy = LeastLoaded()
    tied = [Candidate(A, 1), Candidate(B, 1), Candidate(C, 5)]
    assert [policy.choose([], tied).url for _ in range(4)] == [A, B, A, B]


def test_prefix_hash_keys_on_the_first_blocks_only() -> None:
    policy = PrefixHash(prefix_blocks=2)
    candidates = [Candidate(A), Candidate(B), Candidate(C)]
    doc = chain("doc", 2)
    # The chain is what makes a digest name its whole prefix: same first 2 blocks, same key.
    first = policy.choose(doc + chain("question 1", 3), candidates)
    again = policy.choose(doc + chain("question 2", 1), candidates)
    assert first.url == again.url and first.reason == "hash"
    spread = Counter(policy.choose(chain(f"doc {i}", 4), candidates).url for i in range(300))
    assert set(spread) == {A, B, C} and min(spread.values()) > 60
    short = policy.choose([], [Candidate(A, 2), Candidate(B, 0)])
    assert short == (B, "short-prompt", Overlap())


def test_removing_a_replica_from_the_ring_moves_only_its_keys() -> None:
    keys = [hashlib.sha256(str(i).encode()).digest() for i in range(2000)]
    before = HashRing([A, B, C])
    after = HashRing([A, C])
    owner = {key: before.node_for(key) for key in keys}
    moved = [key for key in keys if after.node_for(key) != owner[key]]
    assert moved and all(owner[key] == B for key in moved)
    assert len(moved) == sum(1 for key in keys if owner[key] == B)


def test_cache_aware_prefers_the_longest_cached_prefix_at_equal_load() -> None:
    policy = CacheAware()
    digests = chain("doc", 10)
    candidates = [Candidate(A, 1, Overlap(2, 0)), Candidate(B, 1, Overlap(8, 0))]
    choice = policy.choose(digests, candidates)
    assert choice == (B, "cache", Overlap(8, 0))
    # cost = (10 - 8) + 1.0 * 1 = 3 for B, (10 - 2) + 1 = 9 for A
    assert policy.cost(10, candidates[1]) == 3.0 and policy.cost(10, candidates[0]) == 9.0


def test_cache_aware_weighs_load_against_overlap() -> None:
    policy = CacheAware(CacheAwareWeights(load_weight=1.0))
    digests = chain("doc", 10)
    # A: (10 - 6) + 7 = 11; B: (10 - 0) + 0 = 10 -> B, although A holds more.
    candidates = [Candidate(A, 7, Overlap(6, 0)), Candidate(B, 0, Overlap())]
    assert policy.choose(digests, candidates) == (B, "load", Overlap())
    # With a cheaper load (0.5 block per request): A = 4 + 3.5 = 7.5 < 10 -> A.
    policy = CacheAware(CacheAwareWeights(load_weight=0.5))
    assert policy.choose(digests, candidates).url == A


def test_cache_aware_credits_a_tier_block_less_than_a_pool_block() -> None:
    digests = chain("doc", 10)
    candidates = [Candidate(A, 0, Overlap(4, 0)), Candidate(B, 0, Overlap(0, 10))]
    # tier weight 0.5: A = 10 - 4 = 6, B = 10 - 5 = 5 -> B
    assert CacheAware().choose(digests, candidates).url == B
    # tier weight 0.3: B = 10 - 3 = 7 -> A
    assert CacheAware(CacheAwareWeights(tier_weight=0.3)).choose(digests, candidates).url == A


def test_cache_aware_balance_guard_overrides_the_cache() -> None:
    policy = CacheAware()  # abs 16, rel 1.5
    digests = chain("doc", 40)
    hot = [Candidate(A, 20, Overlap(40, 0)), Candidate(B, 2, Overlap())]
    assert policy.imbalanced(hot)  # 20 - 2 > 16 and 20 > 1.5 * 2
    assert policy.choose(digests, hot) == (B, "balance", Overlap())
    warm = [Candidate(A, 12, Overlap(40, 0)), Candidate(B, 2, Overlap())]
    assert not policy.imbalanced(warm)  # a gap of 10 is within the threshold
    assert policy.choose(digests, warm).url == A  # 0 + 12 < 40 + 2
    relative = [Candidate(A, 60), Candidate(B, 42)]
    assert not policy.imbalanced(relative)  # 60 < 1.5 * 42


def test_cache_aware_rotates_between_equal_replicas() -> None:
    policy = CacheAware()
    candidates = [Candidate(A), Candidate(B)]
    picks = [policy.choose(chain(f"new {i}", 5), candidates).url for i in range(4)]
    assert picks == [A, B, A, B]
    cached = [Candidate(A), Candidate(B, 0, Overlap(5, 0))]
    assert policy.choose(chain("x", 5), cached).url == B  # no tie: the turn does not advance
    assert policy.choose(chain("new", 5), candidates).url == A


def test_make_policy_knows_every_name() -> None:
    assert POLICY_NAMES == ("cache-aware", "round-robin", "least-loaded", "prefix-hash")
    for name in POLICY_NAMES:
        assert make_policy(name).name == name
    assert make_policy("prefix-hash", prefix_blocks=3).prefix_blocks == 3
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random")
