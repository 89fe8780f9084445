"""Steps sized in time: a fixed cost model (no clock), the real cache manager."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_fixtures import assert_pool_clean, tiny_engine
from prefixcache import KVCacheManager
from prefixcache.cli import build_parser
from prefixcache.engine.config import DEFAULT_STEP_TARGET_MS
from prefixcache.engine.sampling import SamplingParams
from prefixcache.engine.scheduler import (
    FIRST_TOKEN_STEP_SHARE,
    MIN_PREFILL_CHUNK,
    SHARED_HOLD,
    Scheduler,
    step_shape,
)
from prefixcache.engine.step_cost import StepCost, StepShape, chunk_attention
from prefixcache.protocol.access_log import waited_field
from test_scheduler import finish_all, make_request, run_step

# 10 ms a step, 1 ms a prefill token, nothing for context, 5 ms a decode row; 250 ms target.
FIXED = StepCost(prior=(0.010, 1e-3, 0.0, 5e-3), learn=False)
TARGET = 0.250


def timed_scheduler(num_blocks: int = 1024, **options) -> Scheduler:
    manager = KVCacheManager(num_blocks=num_blocks, block_size=16)
    return Scheduler(manager, step_target=TARGET, step_cost=FIXED, **options)


def warm(manager: KVCacheManager, tokens: list[int]) -> None:
    """Compute and cache ``tokens`` as a finished request would have."""
    seq = manager.admit("warm", tokens)
    manager.commit(seq, len(tokens))
    manager.free(seq)


def test_a_cached_request_runs_in_the_next_step_beside_a_long_prefill():
    scheduler = timed_scheduler()
    document = list(range(10_000, 10_512))
    warm(scheduler.manager, document + [1])
    scheduler.add(make_request("long", list(range(5000))).branches[0])
    (first,) = run_step(scheduler)
    assert first.num_tokens == 2048  # alone: the target does not bind
    scheduler.add(make_request("cached", document + [5, 6, 7, 8, 9, 10, 11, 12]).branches[0])
    chunks = run_step(scheduler)
    assert [c.branch.request.request_id for c in chunks] == ["cached", "long"]
    assert (chunks[0].start, chunks[0].num_tokens) == (512, 8)
    assert chunks[0].branch.output.token_ids == [7]  # its first token, this step
    # the step gives "cached" its first token: it is held to a quarter of the target, and
    # the long prompt takes what is left of 62.5 ms: 62.5 - 10 - 8 ms
    assert FIXED.predict(step_shape(chunks)) <= FIRST_TOKEN_STEP_SHARE * TARGET + 1e-9
    assert chunks[1].num_tokens == 44
    finish_all(scheduler)


def test_a_first_token_step_takes_whole_short_prompts_and_a_short_middle_chunk():
    """Both short prompts end (first tokens) within the full target; the long one's middle
    chunk only fills what is left of a quarter of it: 62.5 - 10 - 20 - 20 ms."""
    scheduler = timed_scheduler()
    scheduler.add(make_request("long", list(range(5000))).branches[0])
    run_step(scheduler)
    for i in range(2):
        scheduler.add(make_request(f"short{i}", [4000 + i] * 20).branches[0])
    chunks = run_step(scheduler)
    sizes = {c.branch.request.request_id: c.num_tokens for c in chunks}
    assert sizes == {"short0": 20, "short1": 20, "long": 12}
    assert all(c.branch.output.token_ids for c in chunks[:2])
    (alone,) = [c for c in run_step(scheduler) if c.num_tokens > 1]
    assert alone.num_tokens in (229, 230)  # the full target: 250 - 10 - 2 x 5 ms, floored
    finish_all(scheduler)


def test_a_prompt_left_alone_keeps_the_target_for_the_hold_then_takes_the_budget():
    """A flood client's next prompt comes milliseconds after its last: the one left alone
    meanwhile keeps steps within the target for SHARED_HOLD seconds (fake clock), so an
    arrival then waits one step, not a whole prompt's; after the hold it takes the budget."""
    now = [100.0]
    scheduler = timed_scheduler(clock=lambda: now[0])
    scheduler.add(make_request("long", list(range(8000))).branches[0])
    short = make_request("short", [4000] * 20).branches[0]
    scheduler.add(short)
    run_step(scheduler)  # both in: the target binds
    scheduler.finish(short)  # its client's next prompt is on its way
    now[0] += SHARED_HOLD - 0.01
    (held,) = run_step(scheduler)
    assert held.num_tokens == 240  # alone, within the hold: 250 - 10 ms
    now[0] += 0.02
    (alone,) = run_step(scheduler)
    assert alone.num_tokens == 2048  # the hold is over: the whole budget
    finish_all(scheduler)


def test_running_streams_get_a_token_every_step_under_a_flood():
    scheduler = timed_scheduler(num_blocks=4096)
    streams = [make_request(f"s{i}", [500 + i] * 20, max_tokens=100) for i in range(6)]
    for request in streams:
        scheduler.add(request.branches[0])
    run_step(scheduler)  # all six prefill together (120 tokens)
    for i in range(8):
        scheduler.add(make_request(f"flood{i}", list(range(i * 3000, i * 3000 + 1500))).branches[0])
    for _ in range(20):
        chunks = run_step(scheduler)
        decoded = {c.branch.request.request_id for c in chunks if c.num_tokens == 1}
        assert decoded >= {r.request_id for r in streams}
        assert sum(c.num_tokens for c in chunks if c.num_tokens > 1) > 0  # the flood moves
        assert FIXED.predict(step_shape(chunks)) <= TARGET + 1e-9
    finish_all(scheduler)


def test_decodes_over_the_target_still_leave_a_minimum_prefill_chunk():
    slow = StepCost(prior=(0.010, 1e-3, 0.0, 0.1), learn=False)  # 100 ms a decode row
    manager = KVCacheManager(num_blocks=1024, block_size=16)
    scheduler = Scheduler(manager, step_target=TARGET, step_cost=slow)
    for i in range(4):
        scheduler.add(make_request(f"s{i}", [700 + i] * 4, max_tokens=50).branches[0])
    run_step(scheduler)
    scheduler.add(make_request("long", list(range(3000))).branches[0])
    chunks = run_step(scheduler)
    assert [c.num_tokens for c in chunks] == [1, 1, 1, 1, MIN_PREFILL_CHUNK]
    finish_all(scheduler)


def test_least_uncached_work_first_then_a_long_prompt_ages_and_goes_first():
    scheduler = timed_scheduler(max_num_seqs=1, max_passed_over=3)
    scheduler.add(make_request("long", list(range(1000))).branches[0])
    for i in range(5):
        scheduler.add(make_request(f"short{i}", [3000 + i] * 10, max_tokens=1).branches[0])
    order = []
    while scheduler.waiting or scheduler.running:
        for chunk in run_step(scheduler):
            if chunk.start == 0:
                order.append(chunk.branch.request.request_id)
        for branch in list(scheduler.running):
            if branch.output.token_ids:  # one token each: done
                scheduler.finish(branch)
    assert order == ["short0", "short1", "short2", "long", "short3", "short4"]
    finish_all(scheduler)


def test_the_cost_model_learns_measured_steps():
    cost = StepCost()
    truth = (0.02, 2e-3, 5e-8, 8e-3)
    shapes = [
        StepShape(p, p * (p / 2 + s), d)
        for p in (0, 64, 512, 2048)
        for s in (0, 900)
        for d in (0, 3, 30)
    ]
    for _ in range(20):
        for shape in shapes:
            seconds = truth[0] + truth[1] * shape.prefill_tokens
            seconds += truth[2] * shape.attention + truth[3] * shape.decode_rows
            cost.observe(shape, seconds)
    big = StepShape(1500, 1500 * 1750, 10)
    expected = truth[0] + truth[1] * 1500 + truth[2] * 1500 * 1750 + truth[3] * 10
    assert abs(cost.predict(big) - expected) / expected < 0.05


arrival = st.tuples(
    st.integers(0, 5),  # step at which it arrives
    st.integers(1, 400),  # prompt tokens
    st.integers(0, 2),  # which shared prefix (cached work) it starts with
    st.integers(-1, 1),  # priority
)


@settings(max_examples=100, deadline=None)
@given(st.lists(arrival, min_size=1, max_size=14), st.integers(1, 4))
def test_no_request_waits_past_the_bound_and_no_block_leaks(arrivals, max_num_seqs):
    bound = 3
    scheduler = timed_scheduler(num_blocks=512, max_num_seqs=max_num_seqs, max_passed_over=bound)
    prefixes = [[], list(range(20_000, 20_128)), list(range(30_000, 30_300))]
    pending = sorted(enumerate(arrivals), key=lambda item: item[1][0])
    step = 0
    while pending or scheduler.waiting or scheduler.running:
        while pending and pending[0][1][0] <= step:
            i, (_, length, prefix, priority) = pending.pop(0)
            tokens = prefixes[prefix] + [40_000 + i] * length
            request = make_request(f"r{i}", tokens, max_tokens=2)
            request.priority = priority
            scheduler.add(request.branches[0])
        run_step(scheduler)
        for branch in list(scheduler.running):
            if len(branch.output.token_ids) >= 2:
                scheduler.finish(branch)
        for branch in list(scheduler.waiting) + scheduler.running:
            assert branch.passed_over <= bound
            assert branch.skipped_steps <= bound
        step += 1
        assert step < 500
    finish_all(scheduler)


def test_the_fitted_chunk_is_the_largest_within_the_target():
    cost = StepCost(prior=(0.010, 1e-3, 2e-7, 5e-3), learn=False)
    base = StepShape(0, 3 * 900.0, 3)  # three decodes
    for start in (0, 700, 3000):
        n = cost.tokens_fitting(base, start, 2048, TARGET)

        def with_chunk(count: int, start: int = start) -> float:
            extra = chunk_attention(start, count)
            return cost.predict(StepShape(count, base.attention + extra, base.decode_rows))

        assert 0 < n < 2048 and with_chunk(n) <= TARGET < with_chunk(n + 1)
    assert cost.tokens_fitting(StepShape(0, 0.0, 60), 0, 2048, TARGET) == 0  # over already


def test_queue_time_is_counted_by_reason():
    scheduler = timed_scheduler(max_num_seqs=1)
    scheduler.add(make_request("long", list(range(3000))).branches[0])
    run_step(scheduler)
    scheduler.observe_step(0.5)  # alone: nobody waited
    for i in range(2):
        scheduler.add(make_request(f"short{i}", [4000 + i] * 10).branches[0])
    run_step(scheduler)  # no seat for either
    scheduler.observe_step(0.2)
    assert scheduler.last_waits["seats"] == 2
    assert scheduler.queue_seconds["seats"] == 0.4 and scheduler.queue_seconds["step_time"] == 0
    assert scheduler.step_times.cumulative()[-1] == ("+Inf", 2)
    short = scheduler.waiting[0].request
    assert short.metrics.queue_seconds == {"seats": 0.2}  # what the access log says
    assert waited_field([short.metrics.queue_seconds] * 2) == " waited=seats:0.40s"
    assert waited_field([{}, {"step_time": 0.0}]) == ""
    finish_all(scheduler)


def test_serve_takes_a_step_target_and_zero_turns_it_off(capsys):
    assert build_parser().parse_args(["serve"]).step_target_ms == DEFAULT_STEP_TARGET_MS
    assert build_parser().parse_args(["serve", "--step-target-ms", "0"]).step_target_ms == 0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--step-target-ms", "-5"])
    assert "--step-target-ms" in capsys.readouterr().err


def test_an_aged_prompt_once_admitted_no_longer_goes_ahead_of_short_work():
    slow = StepCost(prior=(0.010, 1e-3, 0.0, 0.1), learn=False)  # decodes fill the target
    manager = KVCacheManager(num_blocks=1024, block_size=16)
    scheduler = Scheduler(manager, step_target=TARGET, step_cost=slow, max_passed_over=2)
    for i in range(3):
        scheduler.add(make_request(f"stream{i}", [700 + i] * 4, max_tokens=500).branches[0])
    run_step(scheduler)
    long = make_request("long", list(range(3000))).branches[0]
    scheduler.add(long)

    def first_prefill(new: str) -> str:
        scheduler.add(make_request(new, [9000 + len(new)] * 10, max_tokens=500).branches[0])
        (prefill,) = [c for c in run_step(scheduler) if c.num_tokens > 1]
        return prefill.branch.request.request_id

    assert [first_prefill(f"s{i}") for i in range(2)] == ["s0", "s1"]  # long passed over
    assert long.passed_over == 2 and long.seq is None
    assert first_prefill("s22") == "long"  # aged: it goes first, and is admitted
    assert long.passed_over == 0  # it had its turn
    assert first_prefill("s333") == "s22"  # short work first again (s22 waited a step)
    finish_all(scheduler)


def test_the_engine_feeds_every_forward_to_the_cost_model():
    engine = tiny_engine(step_target_ms=DEFAULT_STEP_TARGET_MS)
    assert engine.scheduler.step_target == DEFAULT_STEP_TARGET_MS / 1e3
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", [100 + i] * (20 + 30 * i), greedy)
    calls: list[int] = []  # one per forward, urgent ones between a long step's layers too
    engine.model.register_forward_hook(lambda *_: calls.append(1))
    while engine.has_unfinished_requests():
        engine.step()
    forwards = len(calls)
    assert engine.scheduler.step_cost.num_observed == forwards >= 3
    engine.publish_snapshot()
    assert engine.snapshot.step_seconds[-1] == ("+Inf", forwards)
    assert engine.snapshot.step_target == DEFAULT_STEP_TARGET_MS / 1e3
    assert_pool_clean(engine)


def test_pending_prefill_tokens_count_what_is_left_past_each_hit():
    """What a router weighs replicas by: a running prefill's rest, a waiting request's
    tokens past its prefix hit (its whole prompt before it was first matched)."""
    scheduler = timed_scheduler()
    document = list(range(10_000, 10_512))
    warm(scheduler.manager, document + [1])
    scheduler.add(make_request("long", list(range(5000))).branches[0])
    run_step(scheduler)  # alone: 2,048 of its 5,000
    assert scheduler.pending_prefill_tokens() == 5000 - 2048
    cached = make_request("cached", document + list(range(20)))
    scheduler.add(cached.branches[0])
    assert scheduler.pending_prefill_tokens() == 5000 - 2048 + 532  # not matched yet
    scheduler.add(make_request("more", list(range(40_000, 43_000))).branches[0])
    chunks = run_step(scheduler)
    done = {c.branch.request.request_id: c.num_tokens for c in chunks}
    waiting = {b.request.request_id: b.uncached for b in scheduler.waiting}
    left = 5000 - 2048 - done.get("long", 0) + 3000 - done.get("more", 0)
    assert "cached" in done and waiting.get("more", 3000) == 3000
    assert scheduler.pending_prefill_tokens() == left
    finish_all(scheduler)
    assert scheduler.pending_prefill_tokens() == 0
