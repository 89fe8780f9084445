"""Eviction policies: selection, what each one keeps, reset, and the goal on the real trace."""

from __future__ import annotations

import pytest

from conftest import REAL_TRACE, admit_computed
from prefixcache import KVCacheManager
from prefixcache.cache.block_pool import BlockPool, PolicyBlockPool
from prefixcache.cache.policy import POLICY_NAMES, ARCPolicy
from prefixcache.sim.replay import replay
from prefixcache.sim.traces import load_trace

OTHER_POLICIES = [name for name in POLICY_NAMES if name != "lru"]


class Driver:
    """Whole requests of block ids (block size 1, no cap), as the trace replay does."""

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager
        self.count = 0

    def run(self, ids: list[int]) -> int:
        """Admit, compute, free; the blocks served from cache."""
        self.count += 1
        seq = self.manager.admit(f"r{self.count}", ids, cap_last_token=False)
        self.manager.commit(seq, len(ids))
        self.manager.free(seq)
        self.manager.check_invariants()
        return seq.num_cached_tokens

    def scan(self, requests: int) -> None:
        """One-shot two-block requests: content nobody asks for again."""
        for i in range(requests):
            self.run([1000 + 2 * (self.count + i), 1001 + 2 * (self.count + i)])


def test_lru_is_the_plain_pool_and_others_a_policy_pool(make_manager):
    assert type(make_manager(4).pool) is BlockPool
    for name in OTHER_POLICIES:
        pool = make_manager(4, eviction_policy=name).pool
        assert isinstance(pool, PolicyBlockPool) and pool.policy.name == name


def test_unknown_policy_is_a_value_error_listing_the_choices():
    with pytest.raises(ValueError, match=r"unknown eviction_policy 'mru'; choose one of \['lru'"):
        KVCacheManager(4, eviction_policy="mru")


@pytest.mark.parametrize(("policy", "kept"), [("lru", 0), ("arc", 3), ("slru", 3)])
def test_reused_content_survives_a_scan_of_one_shot_prompts(make_manager, policy, kept):
    driver = Driver(make_manager(8, 1, eviction_policy=policy))
    assert [driver.run([1, 2, 3]), driver.run([1, 2, 3])] == [0, 3]
    driver.scan(6)  # 12 new blocks through an 8-block pool
    assert driver.run([1, 2, 3]) == kept


def test_slru_protects_content_recomputed_soon_after_its_eviction(make_manager):
    driver = Driver(make_manager(8, 1, eviction_policy="slru"))
    driver.run([1, 2, 3])
    driver.scan(4)  # evicts 1 2 3 from probation; their digests are remembered
    assert driver.run([1, 2, 3]) == 0  # recomputed: now protected
    driver.scan(6)
    assert driver.run([1, 2, 3]) == 3


@pytest.mark.parametrize(("scan", "kept"), [(3, 3), (6, 3), (10, 0)])
def test_lfuda_prefers_frequent_content_but_ages_it_out(make_manager, scan, kept):
    lru = Driver(make_manager(8, 1))
    lfuda = Driver(make_manager(8, 1, eviction_policy="lfuda"))
    for driver in (lru, lfuda):
        for _ in range(3):
            driver.run([1, 2, 3])
        driver.scan(scan)
    assert lfuda.run([1, 2, 3]) == kept
    assert lru.run([1, 2, 3]) == (2 if scan == 3 else 0)  # recency alone loses it sooner


@pytest.mark.parametrize("policy", OTHER_POLICIES)
def test_empty_blocks_are_reused_before_any_cached_one(make_manager, policy):
    m = make_manager(6, 4, eviction_policy=policy)
    seq = admit_computed(m, "a", list(range(10)))  # 2 full blocks + a partial one
    partial = seq.block_table[-1]
    m.free(seq)
    assert len(m.pool.policy) == 2 and m.pool.free_queue.size == 4
    fresh = m.admit("b", [500])
    assert fresh.block_table == [partial] and m.stats.evictions == 0
    assert m.match(list(range(10))) == 8
    m.free(fresh)


@pytest.mark.parametrize("policy", OTHER_POLICIES)
def test_reset_hands_every_block_back(make_manager, policy):
    m = make_manager(6, 4, eviction_policy=policy)
    m.free(admit_computed(m, "a", list(range(13))))
    assert len(m.pool.policy) == 3
    assert m.reset()
    assert len(m.pool.policy) == 0 and m.pool.free_queue.size == 6
    assert m.match(list(range(13))) == 0
    m.check_invariants()


def test_a_corrupted_policy_fails_the_invariant_check(make_manager):
    m = make_manager(6, 4, eviction_policy="arc")
    m.free(admit_computed(m, "a", list(range(9))))
    policy = m.pool.policy
    assert isinstance(policy, ARCPolicy)
    block = next(iter(policy))
    policy.queue_of[block.block_id] = 1 - policy.queue_of[block.block_id]
    with pytest.raises(AssertionError, match=r"arc: block \d+ lost"):
        m.check_invariants()
    policy.queue_of[block.block_id] = 1 - policy.queue_of[block.block_id]


@pytest.fixture(scope="module")
def real_trace():
    return load_trace(REAL_TRACE)


@pytest.mark.parametrize(
    ("capacity", "lru", "arc", "slru"),
    [(1000, 8.41, 8.90, 8.83), (5000, 27.93, 30.64, 29.98)],
)
def test_arc_and_slru_beat_lru_on_the_real_trace(real_trace, capacity, lru, arc, slru):
    for policy, expected in (("arc", arc), ("slru", slru)):
        rate = 100 * replay(real_trace, capacity, policy).block_hit_rate
        assert round(rate, 2) == expected > lru
