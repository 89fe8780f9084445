"""Retention in the cache core: retained prefixes outlive floods, expire, never block admission."""

from __future__ import annotations

import itertools

import pytest

from clock_fixtures import FakeClock
from conftest import admit_computed
from prefixcache import KVCacheManager
from prefixcache.cache.policies import POLICY_NAMES

BLOCK = 4
POOL = 16
FAIRNESS = [None, {}]  # owner_shares: a plain pool, a tenant-fair one (equal shares)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


_unique = itertools.count(10_000)


def unique_prompt(num_blocks: int) -> list[int]:
    """Tokens no other prompt shares (so every block of it is new content)."""
    return [next(_unique) for _ in range(num_blocks * BLOCK)]


def cache(manager: KVCacheManager, tokens: list[int], *, retain: float = 0.0, **kw) -> int:
    """Admit, compute, optionally retain the whole prompt for ``retain`` s, free; blocks kept."""
    seq = admit_computed(manager, f"r{next(_unique)}", tokens, owner=kw.get("owner"))
    kept = manager.retain(seq, len(tokens), retain, **kw) if retain else 0
    manager.free(seq)
    return kept


def flood(manager: KVCacheManager, num_blocks: int, owner: str | None = "t") -> None:
    """Unique 4-block prompts until ``num_blocks`` blocks of new content have gone through."""
    for _ in range(num_blocks // 4):
        cache(manager, unique_prompt(4), owner=owner)
        manager.check_invariants()


def reusable(manager: KVCacheManager, tokens: list[int]) -> int:
    """Blocks of ``tokens`` still cached (rule 10's cap lifted: every full block counts)."""
    return manager.match(tokens, cap_last_token=False) // BLOCK


# ------------------------------------------------------------ survival and expiry
@pytest.mark.parametrize("fairness", FAIRNESS)
@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_a_retained_prefix_survives_a_flood_that_evicts_an_unretained_one(
    make_manager, clock, policy, fairness
):
    m = make_manager(POOL, BLOCK, eviction_policy=policy, owner_shares=fairness, clock=clock)
    kept, lost = unique_prompt(4), unique_prompt(4)
    assert cache(m, kept, retain=300, owner="t") == 4
    cache(m, lost, owner="t")
    flood(m, 3 * POOL)
    assert reusable(m, kept) == 4
    assert reusable(m, lost) == 0
    assert m.stats.retention_evictions == 0 and m.retained_blocks() == 4


@pytest.mark.parametrize("fairness", FAIRNESS)
@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_after_expiry_a_retained_prefix_is_evictable_again(make_manager, clock, policy, fairness):
    m = make_manager(POOL, BLOCK, eviction_policy=policy, owner_shares=fairness, clock=clock)
    kept = unique_prompt(4)
    cache(m, kept, retain=300, owner="t")
    clock.advance(301)
    assert m.retained_blocks() == 0
    flood(m, 3 * POOL)
    assert reusable(m, kept) == 0
    assert m.stats.retention_expired == 4 and m.stats.retention_evictions == 0


def test_expired_blocks_rejoin_the_policy_as_if_released_when_swept(make_manager, clock):
    """LRU: the expired prefix goes to the tail at the next allocation, behind a later one."""
    m = make_manager(POOL, BLOCK, clock=clock)
    kept, later = unique_prompt(4), unique_prompt(4)
    cache(m, kept, retain=60)
    cache(m, later)
    clock.advance(61)
    cache(m, unique_prompt(POOL - 8 + 4))  # the empties, then 4 victims: ``later``'s blocks
    assert reusable(m, later) == 0
    assert reusable(m, kept) == 4


# ------------------------------------------------------------------ last resort
@pytest.mark.parametrize("fairness", FAIRNESS)
@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_pins_filling_the_pool_never_make_an_admission_fail(make_manager, clock, policy, fairness):
    m = make_manager(
        POOL, BLOCK, eviction_policy=policy, owner_shares=fairness, clock=clock,
        retention_budget=1.0,
    )  # fmt: skip
    early, late = unique_prompt(8), unique_prompt(8)
    assert cache(m, early, retain=60, owner="t") == 8
    assert cache(m, late, retain=3600, owner="u") == 8
    assert m.num_free_blocks == POOL and m.retained_blocks() == POOL
    seq = m.admit("new", unique_prompt(3), owner="t")
    assert seq is not None
    m.check_invariants()
    m.free(seq)
    assert m.stats.retention_evictions == 3 and m.stats.failed_admissions == 0
    assert reusable(m, early) == 5  # the earliest-expiring blocks went, deepest first
    assert reusable(m, late) == 8


def test_retained_blocks_go_deepest_first_within_one_expiry(make_manager, clock):
    m = make_manager(8, BLOCK, clock=clock, retention_budget=1.0)
    pinned = unique_prompt(8)
    cache(m, pinned, retain=60)
    m.free(admit_computed(m, "two", unique_prompt(2)))
    assert reusable(m, pinned) == 6  # the shared shallow prefix stays matchable


def test_retained_blocks_count_as_free_for_capacity(make_manager, clock):
    m = make_manager(8, BLOCK, clock=clock, retention_budget=1.0)
    cache(m, unique_prompt(8), retain=60)
    assert m.match(unique_prompt(8)) == 0
    assert m.num_free_blocks == 8 and m.usage == 0.0
    seq = m.admit("whole", unique_prompt(8))
    assert seq is not None and m.stats.retention_evictions == 8
    m.free(seq)


# ---------------------------------------------------------------------- budgets
def test_the_budget_caps_what_one_owner_retains_and_counts_refusals(make_manager, clock):
    m = make_manager(POOL, BLOCK, clock=clock, retention_budget=0.25)
    assert cache(m, unique_prompt(6), retain=60, owner="a") == 4
    assert m.stats.retention_refused == 2
    assert cache(m, unique_prompt(2), retain=60, owner="a") == 0  # a's budget is full
    assert m.stats.retention_refused == 4
    assert cache(m, unique_prompt(3), retain=60, owner="b") == 3  # b has its own budget
    assert m.retained_blocks() == 7
    clock.advance(61)  # expired marks free the budget again
    assert cache(m, unique_prompt(4), retain=60, owner="a") == 4


def test_per_owner_budgets_override_the_default(make_manager, clock):
    m = make_manager(POOL, BLOCK, clock=clock, retention_budget=0.0, retention_budgets={"vip": 1.0})
    assert cache(m, unique_prompt(4), retain=60, owner="anyone") == 0
    assert cache(m, unique_prompt(4), retain=60) == 0  # no owner: the default share too
    assert cache(m, unique_prompt(12), retain=60, owner="vip") == 12


def test_a_longer_mark_by_another_owner_is_charged_to_it(make_manager, clock):
    m = make_manager(POOL, BLOCK, clock=clock, retention_budgets={"b": 0.0})
    prompt = unique_prompt(2)
    seq = admit_computed(m, "s", prompt)
    assert m.retain(seq, 8, 60, owner="a") == 2
    assert m.retain(seq, 8, 30, owner="b") == 2  # already retained as long: nothing to pay
    assert m.retain(seq, 8, 90, owner="b") == 0  # longer: b's budget (0) refuses it
    assert m.stats.retention_refused == 2
    m.free(seq)


@pytest.mark.parametrize(
    "kwargs",
    [{"retention_budget": 1.5}, {"retention_budget": -0.1}, {"retention_budgets": {"a": 2}}],
)
def test_bad_budgets_are_refused_at_construction(kwargs):
    with pytest.raises(ValueError, match="retention budget"):
        KVCacheManager(POOL, BLOCK, **kwargs)


# ------------------------------------------------------------------------ marks
def test_a_mark_only_extends_an_expiry(make_manager, clock):
    m = make_manager(POOL, BLOCK, clock=clock)
    seq = admit_computed(m, "s", unique_prompt(3))
    assert m.retain(seq, 12, 100) == 3
    assert m.retain(seq, 12, 10, retention_class="1h") == 3  # covered already: unchanged
    clock.advance(50)
    assert m.retained_blocks() == 3
    assert m.retain(seq, 12, 200) == 3
    clock.advance(100)
    assert m.retained_blocks() == 3  # 250 s from the start, not 100 or 110
    m.free(seq)


def test_retain_covers_only_stored_full_blocks(make_manager, clock):
    m = make_manager(POOL, BLOCK, clock=clock)
    seq = m.admit("s", unique_prompt(3) + [1, 2])
    assert m.retain(seq, 100, 60) == 0  # nothing computed yet
    m.commit(seq, 9)  # two full blocks stored
    assert m.retain(seq, 7, 60) == 1  # block-aligned down
    assert m.retain(seq, 100, 60) == 2
    assert m.retained_blocks() == 2
    m.free(seq)


def test_a_hit_on_a_retained_free_block_takes_it_out_and_release_puts_it_back(make_manager, clock):
    m = make_manager(POOL, BLOCK, clock=clock)
    prompt = unique_prompt(3)
    cache(m, prompt, retain=60)
    retention = m.pool.retention
    assert len(retention.free) == 3
    seq = m.admit("again", prompt + [7])
    assert seq.num_cached_tokens == 12 and not retention.free
    assert m.stats.retention_saved_hits == 3
    m.check_invariants()
    m.free(seq)
    assert len(retention.free) == 3  # still unexpired: back into retention
    seq = m.admit("third", prompt + [7])
    clock.advance(61)
    m.free(seq)  # expired while held: back to the policy, mark gone
    assert not retention.free and m.retained_blocks() == 0
    assert m.stats.retention_expired == 3 and len(m.pool.parts) == 3


def test_reset_clears_every_mark(make_manager, clock):
    m = make_manager(POOL, BLOCK, clock=clock)
    prompt = unique_prompt(4)
    cache(m, prompt, retain=60)
    assert m.reset()
    assert m.retained_blocks() == 0 and not m.pool.retention.free
    assert reusable(m, prompt) == 0
    assert m.num_free_blocks == POOL


@pytest.mark.parametrize(
    ("args", "message"),
    [((-1, 60), "num_tokens"), ((4, 0), "ttl_seconds"), ((4, float("inf")), "ttl_seconds")],
)
def test_bad_retain_arguments_raise_and_change_nothing(make_manager, clock, args, message):
    m = make_manager(POOL, BLOCK, clock=clock)
    seq = admit_computed(m, "s", unique_prompt(2))
    with pytest.raises(ValueError, match=message):
        m.retain(seq, *args)
    with pytest.raises(ValueError, match="retention_class"):
        m.retain(seq, 8, 60, retention_class=None)
    assert m.retained_blocks() == 0
    m.free(seq)
    with pytest.raises(ValueError, match="not live"):
        m.retain(seq, 8, 60)


# ------------------------------------------------------------------------ fairness
@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_retained_blocks_are_outside_the_owners_parts(make_manager, clock, policy):
    m = make_manager(POOL, BLOCK, eviction_policy=policy, owner_shares={}, clock=clock)
    cache(m, unique_prompt(4), retain=60, owner="a")
    cache(m, unique_prompt(2), owner="a")
    cache(m, unique_prompt(2), owner="b")
    usage = {u.name: u.cached_blocks for u in m.owner_usage()}
    assert usage == {"a": 2, "b": 2}  # a's 4 retained blocks are not in its part
    clock.advance(61)
    m.free(admit_computed(m, "b-2", unique_prompt(1), owner="b"))  # the sweep: back to a
    usage = {u.name: u.cached_blocks for u in m.owner_usage()}
    assert usage["a"] == 6


def test_another_owners_retained_block_counts_as_crowding_out(make_manager, clock):
    m = make_manager(8, BLOCK, owner_shares={}, clock=clock, retention_budget=1.0)
    cache(m, unique_prompt(8), retain=60, owner="a")
    prompt = unique_prompt(2)
    assert m.would_crowd_out(prompt, owner="a") is False  # a's own retained blocks
    m.free(admit_computed(m, "b", unique_prompt(1), owner="b"))  # registers b (takes one)
    assert m.would_crowd_out(prompt, owner="b") is True


# ---------------------------------------------------------------------- invariants
def test_broken_retention_is_named_by_check_invariants(clock):
    m = KVCacheManager(POOL, BLOCK, clock=clock)
    seq = admit_computed(m, "s", unique_prompt(2))
    held = seq.blocks[0]
    m.pool.retention.free[held.block_id] = held  # a block in use, filed as free
    with pytest.raises(AssertionError, match=r"rule 6: .* in retention while in use"):
        m.check_invariants()
    del m.pool.retention.free[held.block_id]
    m.retain(seq, 8, 60)
    m.free(seq)
    retention = m.pool.retention
    block_id = next(iter(retention.free))
    del retention.free[block_id]  # marked, free, but neither retained nor in the policy
    m.pool.parts.insert([m.pool.blocks[block_id]], 0)
    with pytest.raises(AssertionError, match="marked but not retained"):
        m.check_invariants()


def test_an_owner_over_its_budget_is_named(make_manager, clock):
    m = make_manager(POOL, BLOCK, clock=clock, retention_budget=0.125)
    cache(m, unique_prompt(2), retain=60, owner="a")
    m.pool.retention.shares["a"] = 0.0
    with pytest.raises(AssertionError, match="'a' retains 2 > budget 0"):
        m.check_invariants()
    m.pool.retention.shares["a"] = 0.125


def test_the_expiry_heap_stays_bounded_under_repeated_hits(make_manager, clock):
    m = make_manager(POOL, BLOCK, clock=clock)
    prompt = unique_prompt(2)
    cache(m, prompt, retain=60)
    for round_ in range(200):
        m.free(m.admit(f"hit-{round_}", prompt + [1]))
    retention = m.pool.retention
    assert len(retention.free) == 2 and len(retention.heap) <= 2 * 2 + 64 + 1
    assert m.stats.retention_saved_hits == 400


def test_retention_usage_counts_unexpired_marks_by_owner_and_class(make_manager, clock):
    m = make_manager(POOL, BLOCK, clock=clock)
    cache(m, unique_prompt(3), retain=300, owner="a", retention_class="in_memory")
    cache(m, unique_prompt(2), retain=86400, owner="a", retention_class="24h")
    cache(m, unique_prompt(1), retain=300, retention_class="in_memory")
    assert m.retention_usage() == {("a", "in_memory"): 3, ("a", "24h"): 2, (None, "in_memory"): 1}
    clock.advance(301)
    assert m.retention_usage() == {("a", "24h"): 2}
    assert sum(m.retention_usage().values()) == m.retained_blocks()


# ------------------------------------------------------------ retention_ttl (read-only)
def test_retention_ttl_is_the_seconds_left_on_a_blocks_mark(make_manager, clock):
    m = make_manager(POOL, BLOCK, clock=clock)
    tokens = unique_prompt(3)
    seq = admit_computed(m, "ttl", tokens)
    assert [m.retention_ttl(block) for block in seq.blocks] == [None, None, None]
    assert m.retain(seq, 2 * BLOCK, 600.0, "1h") == 2
    clock.advance(100)
    assert [m.retention_ttl(block) for block in seq.blocks] == [500.0, 500.0, None]
    m.retain(seq, BLOCK, 60.0)  # a shorter mark changes nothing
    assert m.retention_ttl(seq.blocks[0]) == 500.0
    clock.advance(500)
    assert m.retention_ttl(seq.blocks[0]) is None  # expired: unmarked
    m.free(seq)
    m.check_invariants()
