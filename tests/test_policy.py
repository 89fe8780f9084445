"""Eviction policies: selection, adaptation, the signals, the engine, and LRU as the floor."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import REAL_TRACE, admit_computed
from engine_fixtures import assert_pool_clean, run_to_completion, tiny_engine
from prefixcache import KVCacheManager
from prefixcache.cache.hashing import ROOT_UID
from prefixcache.cache.policies import (
    ALL_SIGNALS,
    DOOMED,
    POLICY_NAMES,
    ChainIndex,
    ReuseClasses,
    SignalsPolicy,
    SLRUPolicy,
)
from prefixcache.engine.sampling import SamplingParams
from prefixcache.sim.replay import replay
from prefixcache.sim.synth import FAMILIES, family_config, synth_trace
from prefixcache.sim.traces import load_trace
from test_stateful import STATEFUL_SETTINGS, SmallBlockMachine

OTHER_POLICIES = [name for name in POLICY_NAMES if name != "lru"]
SPLIT_POLICIES = ["arc", "slru", "lfuda"]


class Driver:
    """Whole requests of block ids (block size 1, no cap), as the trace replay does."""

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager
        self.count = 0
        self.fresh = 10_000

    def run(self, ids: list[int]) -> int:
        """Admit, compute, free; the blocks served from cache."""
        self.count += 1
        seq = self.manager.admit(f"r{self.count}", ids, cap_last_token=False)
        self.manager.commit(seq, len(ids))
        self.manager.free(seq)
        self.manager.check_invariants()
        return seq.num_cached_tokens

    def scan(self, requests: int, length: int = 2) -> None:
        """One-shot requests: content nobody asks for again."""
        for _ in range(requests):
            self.run(list(range(self.fresh, self.fresh + length)))
            self.fresh += length


def test_every_policy_is_an_object_injected_into_the_one_pool(make_manager):
    assert make_manager(4).pool.policy.name == "lru"
    for name in OTHER_POLICIES:
        pool = make_manager(4, eviction_policy=name).pool
        assert pool.policy.name == name and pool.parts.policies() == [pool.policy]


def test_unknown_policy_is_a_value_error_listing_the_choices():
    with pytest.raises(ValueError, match=r"unknown eviction_policy 'mru'; choose one of \['lru'"):
        KVCacheManager(4, eviction_policy="mru")


# -------------------------------------------------------------- adaptation
@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_policy_starts_as_lru(make_manager, policy):
    """No evidence yet: a scan flushes reused content, exactly as LRU does."""
    driver = Driver(make_manager(8, 1, eviction_policy=policy))
    assert [driver.run([1, 2, 3]), driver.run([1, 2, 3])] == [0, 3]
    driver.scan(6)  # 12 new blocks through an 8-block pool
    assert driver.run([1, 2, 3]) == 0


@pytest.mark.parametrize("policy", SPLIT_POLICIES)
def test_protection_grows_once_reused_content_comes_back(make_manager, policy):
    driver = Driver(make_manager(8, 1, eviction_policy=policy))
    driver.run([1, 2, 3])
    driver.run([1, 2, 3])  # seen again: protected-to-be
    driver.scan(6)  # evicted after protection, remembered by a ghost list
    assert driver.run([1, 2, 3]) == 0 and driver.manager.pool.policy.limit > 0
    driver.run([1, 2, 3])
    driver.scan(6)
    assert driver.run([1, 2, 3]) == 3  # now it survives the scan


@pytest.mark.parametrize("policy", ["slru", "lfuda"])
def test_protection_shrinks_when_probation_loses_what_comes_back(make_manager, policy):
    driver = Driver(make_manager(8, 1, eviction_policy=policy))
    for _ in range(2):  # grow the protected part, as above
        driver.run([1, 2, 3]), driver.run([1, 2, 3])
        driver.scan(6)
    grown = driver.manager.pool.policy.limit
    for _ in range(8):  # fresh content evicted from probation, then needed again
        batch = [driver.fresh + i for i in range(4)]
        driver.fresh += 4
        driver.run(batch[:2]), driver.run(batch[2:]), driver.run([1, 2, 3])
        driver.scan(3)
        driver.run(batch[:2]), driver.run(batch[2:])
    assert driver.manager.pool.policy.limit < grown


def test_slru_at_limit_zero_is_lru_victim_for_victim():
    trace = synth_trace(family_config("chat", conversations=60, seed=5))

    class FrozenSLRU(SLRUPolicy):
        """SLRU whose protected part never grows: every block passes through probation."""

        features = frozenset()
        name = "slru-frozen"

        def _ghost_hit(self, source: int) -> None:
            return None

    from prefixcache.cache import policies as policy

    policy.POLICIES["slru-frozen"] = FrozenSLRU
    try:
        frozen = replay(trace, 120, "slru-frozen")
    finally:
        del policy.POLICIES["slru-frozen"]
    assert frozen.hits_per_request == replay(trace, 120, "lru").hits_per_request


# ----------------------------------------------------------------- signals
@pytest.fixture
def quick_classes(monkeypatch):
    """Verdicts after a few hundred releases instead of thousands."""
    monkeypatch.setattr(ReuseClasses, "MIN_HALF_LIFE", 256)
    monkeypatch.setattr(ReuseClasses, "DOOMED_EVIDENCE", 32.0)


def test_classes_learn_reuse_rates_and_doom_the_dead_one(quick_classes):
    classes = ReuseClasses(8, frozenset({"seen", "last"}))
    for _ in range(200):
        live = classes.note_release(classes.classify(True, False, 0))
        classes.note_release(classes.classify(False, True, 0))  # a last block: never again
        classes.note_reuse(live)
    last, seen = classes.classify(False, True, 0), classes.classify(True, False, 0)
    assert classes.doomed[last] and not classes.doomed[seen]
    assert classes.pace[last] > 2.0 > 1.0 > classes.pace[seen]  # ages faster, and slower


def test_depth_is_a_class_feature_only_when_enabled():
    plain, deep = ReuseClasses(8, frozenset({"seen"})), ReuseClasses(8, ALL_SIGNALS)
    assert plain.classify(True, True, 20) == plain.classify(True, False, 0) == 2
    assert len({deep.classify(False, False, depth) for depth in (0, 2, 5, 40)}) == 4


@pytest.mark.parametrize("policy", OTHER_POLICIES)
def test_last_blocks_nobody_reuses_are_evicted_first(make_manager, quick_classes, policy):
    manager = make_manager(64, 1, eviction_policy=policy)
    driver = Driver(manager)
    for turn in range(120):  # conversations: a shared prefix, a private tail, a dead last block
        driver.run([1, 2, 3, 100 + turn % 12, 50_000 + turn])
    pool = manager.pool
    assert any(pool.policy.classes.doomed), "the last-block class should be doomed by now"
    doomed = pool.policy.doomed.head.next_free.key
    oldest_other = min(
        (block for block in pool.policy if pool.policy.where[block.block_id] != DOOMED),
        key=lambda block: pool.policy.released_at[block.block_id],
    ).key
    driver.run([90_000])  # one fresh block: one eviction
    assert doomed not in pool.cached and oldest_other in pool.cached  # the dead tail went first


def test_a_doomed_class_recovers_when_its_ghosts_come_back(make_manager, quick_classes):
    driver = Driver(make_manager(64, 1, eviction_policy="slru"))
    for turn in range(120):
        driver.run([1, 2, 3, 50_000 + turn])
    classes = driver.manager.pool.policy.classes
    last = classes.classify(False, True, 0)
    assert classes.doomed[last]
    for turn in range(300):  # now every last block comes back: ghost hits are reuses
        driver.run([1, 2, 3, 70_000 + turn % 40])
    assert not classes.doomed[classes.classify(False, True, 0)]


def orphans(manager: KVCacheManager) -> list:
    """Cached blocks whose parent uid no longer names any block: unreachable content."""
    live = {block.uid for block in manager.pool.blocks if block.uid}
    return [
        block
        for block in manager.pool.cached.values()
        if block.key[0] != ROOT_UID and block.key[0] not in live
    ]


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(POLICY_NAMES), st.randoms(use_true_random=False))
def test_no_policy_ever_leaves_an_orphan(policy, rng):
    manager = KVCacheManager(12, 1, eviction_policy=policy)
    driver = Driver(manager)
    prefixes = [[1, 2], [1, 2, 3, 4], [5], [5, 6, 7]]
    for _ in range(60):
        tail = [rng.randrange(100, 140) for _ in range(rng.randrange(0, 4))]
        driver.run(rng.choice(prefixes) + tail + [driver.fresh])
        driver.fresh += 1
        assert not orphans(manager)


def test_leaf_under_walks_down_to_the_oldest_free_leaf():
    from prefixcache.cache.blocks import Block

    chain = ChainIndex()
    blocks = [Block(i) for i in range(4)]
    for block, (uid, parent) in zip(blocks, [(5, 0), (6, 5), (7, 6), (8, 5)], strict=True):
        block.uid, block.key = uid, (parent, b"")
        chain.add(block)
    assert chain.leaf_under(blocks[0]) is blocks[2]  # 5 -> 6 -> 7, the older branch
    chain.remove(blocks[2])
    assert chain.leaf_under(blocks[0]) is blocks[1] and len(chain) == 3


# ----------------------------------------------------- pool-level behaviour
@pytest.mark.parametrize("policy", OTHER_POLICIES)
def test_empty_blocks_are_reused_before_any_cached_one(make_manager, policy):
    m = make_manager(6, 4, eviction_policy=policy)
    seq = admit_computed(m, "a", list(range(10)))  # 2 full blocks + a partial one
    partial = seq.block_table[-1]
    m.free(seq)
    assert len(m.pool.policy) == 2 and m.pool.empty_queue.size == 4
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
    assert len(m.pool.policy) == 0 and m.pool.empty_queue.size == 6
    assert m.match(list(range(13))) == 0
    m.check_invariants()


def test_a_corrupted_policy_fails_the_invariant_check(make_manager):
    m = make_manager(6, 4, eviction_policy="arc")
    m.free(admit_computed(m, "a", list(range(9))))
    policy = m.pool.policy
    block = next(iter(policy))
    policy.where[block.block_id] = -1
    with pytest.raises(AssertionError, match=r"arc: \d+ marked, 2 held"):
        m.check_invariants()
    policy.where[block.block_id] = 1


class SignalsMachine(SmallBlockMachine):
    eviction_policy = "signals"


class DeepSignals(SignalsPolicy):
    """Every signal, depth too: exercises the chain depths under random operations."""

    features = ALL_SIGNALS


class DeepSignalsMachine(SmallBlockMachine):
    eviction_policy = "signals-deep"

    def __init__(self) -> None:
        from prefixcache.cache import policies as policy

        policy.POLICIES.setdefault("signals-deep", DeepSignals)
        super().__init__()


TestSignalsMachine = SignalsMachine.TestCase
TestDeepSignalsMachine = DeepSignalsMachine.TestCase
TestSignalsMachine.settings = TestDeepSignalsMachine.settings = STATEFUL_SETTINGS


# ------------------------------------------------------------------- engine
def multi_turn_workload(seed: int) -> list[tuple[str, list[int]]]:
    """Two system prompts, first turns, then some second turns on top of them."""
    rng = random.Random(seed)
    systems = [[rng.randrange(100, 5000) for _ in range(30)] for _ in range(2)]
    return [
        (f"c{i}", rng.choice(systems) + [rng.randrange(100, 5000) for _ in range(9)])
        for i in range(10)
    ]


def run_conversations(policy: str, caching: bool) -> tuple[dict, object]:
    engine = tiny_engine(
        enable_prefix_caching=caching, eviction_policy=policy, num_kv_blocks=40,
        max_num_seqs=4, max_num_batched_tokens=48,
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = multi_turn_workload(0)
    for request_id, prompt in first:
        engine.add_request(request_id, prompt, params)
    outputs = {k: v.outputs[0].token_ids for k, v in run_to_completion(engine).items()}
    for request_id, prompt in first[:6]:
        engine.add_request(request_id + "/2", prompt + outputs[request_id] + [77, 78], params)
    outputs.update({k: v.outputs[0].token_ids for k, v in run_to_completion(engine).items()})
    assert_pool_clean(engine)
    return outputs, engine


@pytest.fixture(scope="module")
def uncached_tokens() -> dict:
    """The workload's tokens with caching off (no policy is involved then)."""
    return run_conversations("lru", caching=False)[0]


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_the_engine_gives_the_same_tokens_with_every_policy(policy, uncached_tokens):
    cached, engine = run_conversations(policy, caching=True)
    assert cached == uncached_tokens
    assert engine.manager.stats.hits > 0 and engine.manager.stats.evictions > 0


# ------------------------------------------------------- LRU is the floor
def test_every_policy_is_at_least_lru_on_the_real_trace():
    trace = load_trace(REAL_TRACE)
    lru = replay(trace, 5000, "lru").hit_blocks
    for policy in OTHER_POLICIES:
        assert replay(trace, 5000, policy).hit_blocks >= lru, policy


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_policy_is_at_least_lru_on_small_generated_families(family):
    trace = synth_trace(family_config(family, conversations=200))
    for capacity in (600, 1200):
        lru = replay(trace, capacity, "lru").hit_blocks
        for policy in OTHER_POLICIES:
            assert replay(trace, capacity, policy).hit_blocks >= lru, (policy, capacity)
