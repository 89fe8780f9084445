"""The ``learned`` policy: its model, its LRU guard, LRU order without evidence, and gains."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache import KVCacheManager
from prefixcache.cache.policies import POLICIES, LearnedPolicy
from prefixcache.cache.policies.lru_guard import LRUGuard
from prefixcache.cache.policies.reuse_model import BINS, ReuseModel, age_bin
from prefixcache.sim.replay import replay
from prefixcache.sim.synth import family_config, synth_trace
from test_policy import Driver
from test_stateful import STATEFUL_SETTINGS, SmallBlockMachine


def test_age_bins_are_bit_lengths_capped_at_the_last():
    assert [age_bin(a) for a in (0, 1, 2, 3, 4, 7, 8)] == [0, 1, 2, 2, 3, 3, 4]
    assert age_bin(2**60) == BINS - 1


def test_without_evidence_every_class_predicts_alike():
    model = ReuseModel(1000, 4)
    assert len({tuple(row) for row in model.prediction}) == 1
    model.refresh()  # no counts at all: still one curve for every class
    assert len({tuple(row) for row in model.prediction}) == 1


def test_the_model_rates_a_reused_class_above_a_dead_one():
    model = ReuseModel(100, 2)
    for _ in range(2000):
        model.note_releases([0, 1])
        model.note_reuse(0, 50)  # class 0 always comes back after 50 releases; class 1 never
    model.refresh()
    young = age_bin(10)
    assert model.prediction[0][young] > 0.9 and model.prediction[1][young] < 0.1
    assert model.prediction[1][young] < LearnedPolicy.MARGIN * model.prediction[0][young]


def test_the_pooled_curve_never_rises_with_age():
    model = ReuseModel(100, 1)
    model.note_releases([0] * 5000)
    for age in (3, 300, 3000):  # reuses at three ages: the raw curve rises and falls
        for _ in range(500):
            model.note_reuse(0, age)
    raw, _ = model._curve(model.reused[0], 5000.0)
    assert any(a < b for a, b in itertools.pairwise(raw))  # the class's own rises
    pooled = model.pooled_curve()
    assert all(a >= b for a, b in itertools.pairwise(pooled))


def test_the_guard_falls_back_to_lru_while_trailing_and_backs_off_each_failure():
    guard = LRUGuard(64)
    assert guard.threshold == 256 and guard.capacity == 64  # a small pool: everything sampled
    digests = [bytes([i % 256, i // 256]) for i in range(32)]

    def window(hit: bool) -> None:
        for step in range(LRUGuard.WINDOW):
            guard.reference(digests[step % 32], hit=hit)

    window(hit=False)  # the shadow holds all 32 and hits; the pool hit nothing
    assert (guard.trusted, guard.failures, guard.spell) == (False, 1, 2)
    window(hit=False)  # one window as LRU, then a new trial
    assert guard.trusted
    window(hit=False)  # failed again: two windows of LRU this time
    assert (guard.trusted, guard.failures, guard.lru_windows_left) == (False, 2, 2)
    window(hit=True)
    window(hit=True)
    assert guard.trusted
    window(hit=True)  # as good as the shadow: the spell shrinks back
    assert guard.trusted and guard.spell == 2
    assert len(guard.shadow) <= guard.capacity


def test_a_large_pool_samples_a_sixteenth_of_the_content():
    guard = LRUGuard(100_000)
    assert guard.threshold == 16 and guard.capacity == 6250
    assert guard.sampled(bytes([15])) and not guard.sampled(bytes([16]))
    assert not guard.sampled(None)


@given(st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=6), max_size=40))
@settings(max_examples=60, deadline=None)
def test_without_evidence_learned_serves_exactly_what_lru_serves(requests):
    """Fewer releases than one model refresh: every class alike, so LRU's victims."""
    ours = Driver(KVCacheManager(12, 1, eviction_policy="learned"))
    lru = Driver(KVCacheManager(12, 1, eviction_policy="lru"))
    for ids in requests:
        chain = list(dict.fromkeys(ids))
        assert ours.run(chain) == lru.run(chain)


def test_learned_keeps_documents_a_scan_would_flush():
    """Recomputed documents are 'seen'; one-shot scans never come back: the model learns
    it and evicts scan blocks first, where LRU loses every document."""
    hits = {}
    for policy in ("lru", "learned"):
        driver = Driver(KVCacheManager(64, 1, eviction_policy=policy))
        served = 0
        for round_number in range(400):
            document = round_number % 8
            served += driver.run([100 * document + k for k in range(1, 5)])
            driver.scan(2, length=8)
        hits[policy] = served
    assert hits["lru"] == 0
    assert hits["learned"] > 400  # most of the 1,600 document blocks, once learned


class Contrary(LearnedPolicy):
    """A model gone wrong: it evicts the block released last (MRU) whenever it is trusted."""

    name = "learned-contrary"

    def _select(self):
        lists = [queue for queue in self.lists if queue.size]
        newest = max((queue.tail.prev_free for queue in lists), key=self._released)
        return newest

    def _released(self, block):
        return self.released_at[block.block_id]


class Unguarded(Contrary):
    """The same, with a guard that never judges."""

    name = "learned-contrary-unguarded"

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.guard.WINDOW = 10**12


def test_the_guard_bounds_what_a_wrong_model_costs():
    POLICIES.setdefault(Contrary.name, Contrary)
    POLICIES.setdefault(Unguarded.name, Unguarded)
    trace = synth_trace(family_config("chat", conversations=1500))
    lru = replay(trace, 600, "lru").hit_blocks
    guarded = replay(trace, 600, Contrary.name).hit_blocks
    unguarded = replay(trace, 600, Unguarded.name).hit_blocks
    assert unguarded < 0.8 * lru  # the wrong model alone loses a third of LRU's hits
    assert guarded >= 0.95 * lru, (guarded, lru)  # the guard gives back nearly all of it


class LearnedMachine(SmallBlockMachine):
    eviction_policy = "learned"


TestLearnedMachine = LearnedMachine.TestCase
TestLearnedMachine.settings = STATEFUL_SETTINGS
