"""Fair admission: a tenant with requests running waits for its own blocks rather than
evict another tenant's cached blocks within that tenant's share of the pool."""

from __future__ import annotations

import random

from conftest import admit_computed
from engine_fixtures import assert_pool_clean, run_to_completion, tiny_engine
from prefixcache.engine.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


def unique(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 20_000) for _ in range(n)]


def test_the_check_replays_the_pools_victims(make_manager):
    manager = make_manager(16, 4, owner_shares={})  # A and B: 8 blocks each of the pool
    system = unique(16, 0)
    manager.free(admit_computed(manager, "a", system + [1], owner="A"))  # 4 cached, A's
    b1 = admit_computed(manager, "b1", unique(28, 1), owner="B")  # 7 live: 5 blocks free
    assert not manager.would_crowd_out(unique(20, 2), owner="B")  # 5 blocks: the empty ones
    assert manager.would_crowd_out(unique(24, 3), owner="B")  # a 6th would be A's
    assert not manager.would_crowd_out(system + [2], owner="A")  # its own hit: 1 block
    assert not manager.would_crowd_out(unique(24, 3), owner="C")  # never admitted: no owner
    manager.free(b1)
    assert not manager.would_crowd_out(unique(24, 3), owner="B")  # B's own blocks now


def test_a_hit_on_another_owners_block_is_not_an_empty_block(make_manager):
    manager = make_manager(8, 4, owner_shares={})  # 4 blocks each
    a_prompt = unique(12, 0)
    manager.free(admit_computed(manager, "a", a_prompt + [1], owner="A"))  # 3 cached
    manager.free(admit_computed(manager, "b", unique(4, 1) + [1], owner="B"))  # 1 cached
    prompt = a_prompt[:4] + unique(16, 2) + [1]  # 6 blocks: A's first, 4 empty, 1 evicted
    assert manager.would_crowd_out(prompt, owner="B")  # the victim would be A's
    manager.free(admit_computed(manager, "b2", prompt, owner="B"))
    assert {u.name: u.evictions_suffered for u in manager.owner_usage()}["A"] == 1


def test_an_owner_over_its_share_is_not_protected(make_manager):
    manager = make_manager(16, 4, owner_shares={"A": 0.25, "B": 0.75})  # A: 4 blocks
    for i in range(3):  # A caches 12 blocks, over its share
        manager.free(admit_computed(manager, f"a{i}", unique(16, 10 + i), owner="A"))
    b1 = admit_computed(manager, "b1", unique(8, 1), owner="B")  # 2 live: 2 empty left
    assert not manager.would_crowd_out(unique(40, 2), owner="B")  # A down to 4 at most
    assert manager.would_crowd_out(unique(64, 3), owner="B")  # below A's share
    manager.free(b1)
    plain = make_manager(16, 4)
    plain.free(admit_computed(plain, "a", unique(16, 10), owner="A"))
    assert not plain.would_crowd_out(unique(64, 3), owner="B")  # not fair: nobody waits


def test_a_busy_tenant_waits_while_another_tenant_goes_ahead_and_hits():
    engine = tiny_engine(  # FCFS (no step target): else a2, cached, would go first anyway
        num_kv_blocks=24, owner_shares={}, max_num_batched_tokens=512, step_target_ms=None
    )
    system = unique(32, 0)  # 8 blocks of 4
    engine.add_request("a1", system + [5], GREEDY, owner="A")
    run_to_completion(engine)
    engine.add_request("b1", unique(40, 1), GREEDY, owner="B")  # 10 blocks, runs at once
    engine.add_request("b2", unique(40, 2), GREEDY, owner="B")  # would need A's blocks
    engine.add_request("a2", system + [6], GREEDY, owner="A")  # arrives after b2
    engine.step()
    running = {branch.request.request_id for branch in engine.scheduler.running}
    assert running == {"b1", "a2"}  # b2 waits for B's own blocks; a2 passed it
    finals = run_to_completion(engine)
    assert finals["a2"].num_cached_tokens == 32 and set(finals) == {"b1", "b2", "a2"}
    assert engine.scheduler.num_fair_deferrals >= 1
    assert_pool_clean(engine)


def test_without_fair_cache_nobody_is_deferred():
    engine = tiny_engine(num_kv_blocks=24, max_num_batched_tokens=512, step_target_ms=None)
    system = unique(32, 0)
    engine.add_request("a1", system + [5], GREEDY, owner="A")
    run_to_completion(engine)
    for name, seed in (("b1", 1), ("b2", 2)):
        engine.add_request(name, unique(40, seed), GREEDY, owner="B")
    engine.add_request("a2", system + [6], GREEDY, owner="A")
    engine.step()
    assert {b.request.request_id for b in engine.scheduler.running} >= {"b1", "b2"}  # FCFS
    finals = run_to_completion(engine)
    assert finals["a2"].num_cached_tokens < 32  # b2 evicted A's prompt
    assert engine.scheduler.num_fair_deferrals == 0
    assert_pool_clean(engine)


def test_with_a_step_target_a_busy_tenant_still_waits_for_its_own_blocks():
    engine = tiny_engine(
        num_kv_blocks=24, owner_shares={}, max_num_batched_tokens=512, step_target_ms=250
    )
    system = unique(32, 0)
    engine.add_request("a1", system + [5], GREEDY, owner="A")
    run_to_completion(engine)
    engine.add_request("b1", unique(40, 1), GREEDY, owner="B")
    engine.add_request("b2", unique(40, 2), GREEDY, owner="B")  # would need A's blocks
    engine.step()
    assert {branch.request.request_id for branch in engine.scheduler.running} == {"b1"}
    assert engine.scheduler.last_waits["fairness"] == 1
    engine.add_request("a2", system + [6], GREEDY, owner="A")
    finals = run_to_completion(engine)
    assert finals["a2"].num_cached_tokens == 32  # B's wait kept A's prompt cached
    assert engine.scheduler.num_fair_deferrals >= 1
    assert_pool_clean(engine)
