"""Long prompts in steps of their own, urgent steps between their layers (issue 36).

The tiny models run in float64, so a different batching cannot flip a greedy choice: every
request's tokens must equal those of an engine that steps in tokens only. What counts as
long comes from the cost model's fixed prior (1.1 ms a token: over ~45 new tokens do not fit
four 60 ms steps), and decodes fall due by a fake clock, never by real time.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_fixtures import assert_pool_clean, run_to_completion, tiny_engine, tiny_gemma_model
from prefixcache.engine.async_engine import AbortRequest, AddRequest, AsyncLLMEngine
from prefixcache.engine.engine import LLMEngine
from prefixcache.engine.request import RequestOutput
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.engine.step_cost import StepCost

TARGET_MS = 60.0
LONG = 400  # new tokens: over the ~200 that four target steps finish, by the prior


def greedy(tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)


def interleaving_engine(model=None, **options: object) -> LLMEngine:
    """Long prompts interleaved; the cost model's prior only; time stands still."""
    options = {"num_kv_blocks": 256, **options}
    engine = tiny_engine(model, step_target_ms=TARGET_MS, **options)
    engine.scheduler.step_cost = StepCost(learn=False)
    engine.scheduler.clock = lambda: 0.0
    return engine


def prompt(seed: int, length: int) -> list[int]:
    return [100 + (seed * 37 + i * 11) % 900 for i in range(length)]


def reference_tokens(requests: dict[str, tuple[list[int], int]], model=None) -> dict:
    """Each request's greedy tokens from an engine stepping in tokens only, all at once."""
    engine = tiny_engine(model, num_kv_blocks=256)
    for request_id, (tokens, out) in requests.items():
        engine.add_request(request_id, tokens, greedy(out))
    return {r: o.token_ids for r, o in run_to_completion(engine).items()}


class Arrivals:
    """Adds each request at its turn: the n-th time the engine looks between layers."""

    def __init__(self, engine: LLMEngine, plan: dict[int, list[tuple[str, list[int], int]]]):
        self.engine, self.plan, self.calls = engine, plan, 0
        self.delivered: list[RequestOutput] = []
        engine.between.arrivals = self
        engine.between.on_outputs = self.delivered.extend

    def __call__(self) -> None:
        self.engine.manager.check_invariants()  # between layers too
        for request_id, tokens, out in self.plan.pop(self.calls, []):
            self.engine.add_request(request_id, tokens, greedy(out))
        self.calls += 1


def test_a_short_prompt_arriving_mid_step_gets_its_first_token_before_the_long_step_lands():
    engine = interleaving_engine()
    engine.add_request("long", prompt(1, LONG), greedy(2))
    arrivals = Arrivals(engine, {1: [("short", prompt(2, 12), 2)]})
    outputs = engine.step()  # the long prompt: one step of its own
    early = [o for o in arrivals.delivered if o.request_id == "short"]
    assert early and early[0].token_ids  # delivered during the long step, not after it
    assert early[-1].finished  # its decode too: time stands still, a decode is always due
    (late,) = [o for o in outputs if o.request_id == "long"]
    assert late.token_ids and late.metrics.first_token_time > early[0].metrics.first_token_time
    assert not engine.scheduler.in_flight  # landed
    engine.publish_snapshot()
    assert engine.snapshot.num_long_steps == 1 and engine.snapshot.num_urgent_steps == 2
    run_to_completion(engine)
    assert_pool_clean(engine)


def test_running_streams_get_tokens_between_the_long_steps_layers():
    engine = interleaving_engine()
    engine.add_request("stream", prompt(3, 8), greedy(40))
    engine.step()  # prefilled: the stream now decodes
    now = [0.0]
    engine.scheduler.clock = lambda: now.__setitem__(0, now[0] + 1.0) or now[0]  # always due
    engine.add_request("long", prompt(4, LONG), greedy(1))
    arrivals = Arrivals(engine, {})
    outputs = engine.step()
    streamed = [len(o.token_ids) for o in arrivals.delivered if o.request_id == "stream"]
    assert len(streamed) >= 3 and streamed == sorted(streamed)  # one token each time, in order
    assert any(o.request_id == "long" and o.finished for o in outputs)
    finals = run_to_completion(engine)
    expected = reference_tokens({"stream": (prompt(3, 8), 40)})
    assert finals["stream"].token_ids == expected["stream"]
    assert_pool_clean(engine)


def test_a_prompt_whose_prefix_the_long_step_is_computing_waits_for_it_then_hits():
    engine = interleaving_engine()
    shared = prompt(5, LONG + 20)
    engine.add_request("long", shared, greedy(2))
    Arrivals(engine, {0: [("same start", shared[:LONG] + prompt(6, 6), 3)]})
    engine.step()  # the follower's hit would read blocks the long step was still writing
    assert "same start" not in engine.scheduler.in_flight
    follower = next(b for b in engine.scheduler.waiting if b.request.request_id == "same start")
    assert follower.seq is None  # it waited for the step
    finals = run_to_completion(engine)
    assert finals["same start"].num_cached_tokens == LONG  # then hit what it had computed
    expected = reference_tokens({"same start": (shared[:LONG] + prompt(6, 6), 3)})
    assert finals["same start"].token_ids == expected["same start"]
    assert_pool_clean(engine)


def test_an_abort_sent_during_a_long_step_waits_for_it_to_land():
    engine = interleaving_engine()
    driver = AsyncLLMEngine(engine)  # not started: this thread plays its engine thread
    engine.add_request("long", prompt(7, LONG), greedy(3))
    added = driver._submit(AddRequest("short", prompt(8, 10), greedy(2)))
    aborted = driver._submit(AbortRequest("long"))  # its blocks are being written
    engine.step()
    assert added.done() and not aborted.done()  # the add ran between layers, the abort waits
    driver._drain_commands()
    assert aborted.result().request_id == "long" and "long" not in engine.requests
    run_to_completion(engine)
    assert_pool_clean(engine)


def test_preemption_between_layers_never_takes_the_long_steps_branches():
    engine = interleaving_engine(num_kv_blocks=103)  # the stream's 3 blocks, the long's 100
    engine.add_request("stream", prompt(9, 8), greedy(30))
    engine.step()
    engine.add_request("long", prompt(10, LONG), greedy(1))  # admitted last: preempt_last's
    engine.scheduler.clock = itertools.count().__next__  # decodes always due
    long_branch = engine.scheduler.waiting[-1]
    finals = run_to_completion(engine)
    assert engine.scheduler.num_preemptions >= 1 and long_branch.num_preemptions == 0
    assert finals["long"].token_ids and len(finals["stream"].token_ids) == 30
    expected = reference_tokens({"stream": (prompt(9, 8), 30), "long": (prompt(10, LONG), 1)})
    assert {r: o.token_ids for r, o in finals.items()} == expected
    assert_pool_clean(engine)


@pytest.mark.parametrize("model", [None, tiny_gemma_model()], ids=["llama", "gemma3-hybrid"])
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_arrivals_between_layers_give_the_same_tokens_and_leak_nothing(model, data):
    prefix = prompt(11, data.draw(st.integers(0, 60)))
    requests, plan = {}, {}
    for i in range(data.draw(st.integers(1, 6))):
        tokens = data.draw(st.sampled_from([prefix, []])) + prompt(20 + i, data.draw(
            st.integers(1, LONG + 30)))  # fmt: skip
        out = data.draw(st.integers(1, 12))
        requests[f"r{i}"] = (tokens, out)
        plan.setdefault(data.draw(st.integers(-1, 8)), []).append((f"r{i}", tokens, out))
    engine = interleaving_engine(model, num_kv_blocks=data.draw(st.sampled_from([256, 1024])))
    for request_id, tokens, out in plan.pop(-1, []):  # these are there from the start
        engine.add_request(request_id, tokens, greedy(out))
    arrivals = Arrivals(engine, plan)
    engine.scheduler.clock = itertools.count(step=data.draw(st.sampled_from([0, 1]))).__next__
    finals = {}
    while engine.has_unfinished_requests() or arrivals.plan:
        outputs = engine.step() if engine.has_unfinished_requests() else []
        if not engine.has_unfinished_requests() and arrivals.plan:
            arrivals()  # nobody runs: the next arrivals come between steps
        for output in arrivals.delivered + outputs:
            if output.finished:
                finals[output.request_id] = output.token_ids
        arrivals.delivered.clear()
    assert finals == reference_tokens(requests, model)
    assert_pool_clean(engine)


def test_a_long_prompt_without_a_seat_leaves_the_steps_to_those_running():
    engine = interleaving_engine(max_num_seqs=1)
    engine.add_request("stream", prompt(12, 8), greedy(20))
    engine.step()
    engine.add_request("long", prompt(13, LONG), greedy(1))  # long, and no seat for it
    engine.step()
    assert engine.scheduler.last_shape.decode_rows == 1  # the stream went on
    finals = run_to_completion(engine)
    assert len(finals["stream"].token_ids) == 20 and finals["long"].token_ids
    assert_pool_clean(engine)


def test_a_preempted_stream_recomputed_in_a_long_step_is_not_also_decoded_between_layers():
    engine = interleaving_engine(enable_prefix_caching=False)  # the recompute is all new work
    engine.add_request("stream", prompt(14, 8), greedy(LONG + 20))
    for _ in range(LONG + 10):
        engine.step()
    engine.scheduler.preempt_last()  # 8 + LONG + 9 tokens to compute again: a long step's
    Arrivals(engine, {0: [("short", prompt(15, 6), 3)]})  # an urgent step between its layers
    engine.step()
    finals = run_to_completion(engine)
    expected = reference_tokens({"stream": (prompt(14, 8), LONG + 20), "short": (prompt(15, 6), 3)})
    assert {r: o.token_ids for r, o in finals.items()} == expected
    assert_pool_clean(engine)


def test_an_urgent_step_that_fails_between_layers_aborts_all_and_the_engine_goes_on(monkeypatch):
    engine = interleaving_engine()
    engine.add_request("long", prompt(16, LONG), greedy(2))
    Arrivals(engine, {1: [("short", prompt(17, 6), 2)]})
    original = engine.model.forward

    def fails_on_the_urgent_one(input_ids, *args, **kwargs):
        if len(input_ids) < 10:
            raise RuntimeError("simulated kernel failure")
        return original(input_ids, *args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", fails_on_the_urgent_one)
    with pytest.raises(RuntimeError, match="simulated"):
        engine.step()
    assert_pool_clean(engine)  # both aborted, the long step landed, nothing half-written kept
    assert engine.manager.match(prompt(16, LONG)) == 0
    monkeypatch.setattr(engine.model, "forward", original)
    engine.add_request("again", prompt(16, LONG), greedy(2))
    assert len(run_to_completion(engine)["again"].token_ids) == 2


def test_the_cost_model_learns_each_step_by_its_own_shape():
    engine = interleaving_engine()
    observed = []
    engine.scheduler.observe_step = lambda seconds, shape: observed.append(shape)
    engine.add_request("long", prompt(18, LONG), greedy(1))
    Arrivals(engine, {0: [("short", prompt(19, 12), 1)]})  # runs before the long forward
    engine.step()
    assert [s.prefill_tokens for s in observed] == [12, LONG]  # not the urgent one's twice


def test_a_short_prompt_waiting_beside_a_long_one_runs_before_the_long_step():
    engine = interleaving_engine()
    engine.add_request("long", prompt(20, LONG), greedy(1))
    engine.add_request("short", prompt(21, 12), greedy(1))
    arrivals = Arrivals(engine, {})
    outputs = engine.step()  # the long prompts' step: the short one is not in it
    (short,) = [o for o in arrivals.delivered if o.request_id == "short"]
    (long,) = [o for o in outputs if o.request_id == "long"]
    assert short.finished and short.metrics.first_token_time < long.metrics.first_token_time


def test_a_short_prompt_that_cannot_run_does_not_make_every_layer_an_urgent_step():
    engine = interleaving_engine(max_num_seqs=2)
    engine.add_request("stream", prompt(22, 8), greedy(30))
    engine.step()
    engine.add_request("long", prompt(23, LONG), greedy(1))
    Arrivals(engine, {0: [("no seat", prompt(24, 12), 1)]})  # both seats are taken
    engine.step()
    assert engine.scheduler.num_urgent_steps == 1  # the stream's one token, not one a layer
    finals = run_to_completion(engine)
    assert finals["no seat"].token_ids
    assert_pool_clean(engine)


def test_a_lone_prompt_between_layers_goes_whole_and_beside_a_stream_in_timed_chunks():
    engine = interleaving_engine()
    engine.add_request("long", prompt(25, LONG), greedy(1))
    Arrivals(engine, {0: [("turn", prompt(26, 150), 1)]})  # 150 tokens: three target steps
    engine.step()
    assert engine.scheduler.num_urgent_steps == 1  # nobody else to wait for it
    run_to_completion(engine)
    engine.add_request("stream", prompt(27, 8), greedy(30))
    engine.step()
    engine.add_request("long 2", prompt(28, LONG), greedy(1))
    Arrivals(engine, {0: [("turn 2", prompt(29, 150), 1)]})
    engine.step()
    assert engine.scheduler.num_urgent_steps >= 1 + 3  # the stream's gap bounds its steps
    run_to_completion(engine)
    assert_pool_clean(engine)
