"""The engine on a tiny random model: caching never changes tokens, limits, lifecycle."""

from __future__ import annotations

import random

import pytest

from engine_fixtures import assert_pool_clean, run_to_completion, tiny_engine
from prefixcache import CapacityError
from prefixcache.engine.request import FinishReason
from prefixcache.engine.sampling import SamplingParams


def random_workload(seed: int) -> list[tuple[str, list[int], SamplingParams]]:
    """Shared system prefixes, unrelated prompts, and seeded forks (n = 2)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(100, 5000) for _ in range(rng.randrange(20, 60))] for _ in range(3)]
    requests = []
    for i in range(14):
        tail = [rng.randrange(100, 5000) for _ in range(rng.randrange(1, 25))]
        prompt = (rng.choice(systems) if rng.random() < 0.7 else []) + tail
        if rng.random() < 0.25:
            params = SamplingParams(
                n=2, temperature=0.8, seed=i, max_tokens=rng.randrange(3, 12), ignore_eos=True
            )
        else:
            params = SamplingParams(temperature=0, max_tokens=rng.randrange(3, 20), ignore_eos=True)
        requests.append((f"w{seed}-{i}", prompt, params))
    return requests


def run_workload(caching: bool, seed: int) -> tuple[dict, object]:
    """Two turns: every request, then a follow-up that resends its history."""
    engine = tiny_engine(
        enable_prefix_caching=caching, num_kv_blocks=48, max_num_seqs=6, max_num_batched_tokens=48
    )
    results = {}
    first_turn = random_workload(seed)
    for request_id, prompt, params in first_turn:
        engine.add_request(request_id, prompt, params)
    results.update(run_to_completion(engine))
    for request_id, prompt, _ in first_turn[:6]:  # multi-turn: history + a new message
        history = prompt + results[request_id].token_ids + [1234, 99, 7]
        engine.add_request(
            request_id + "/2", history, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        )
    results.update(run_to_completion(engine))
    assert_pool_clean(engine)
    tokens = {rid: [o.token_ids for o in out.outputs] for rid, out in results.items()}
    return tokens, engine


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_caching_never_changes_the_tokens(seed):
    cached_tokens, cached = run_workload(caching=True, seed=seed)
    plain_tokens, plain = run_workload(caching=False, seed=seed)
    assert cached_tokens == plain_tokens
    assert cached.manager.stats.hits > 0 and plain.manager.stats.hits == 0
    assert cached.manager.stats.evictions > 0  # the pool was small enough to churn


def test_preemption_recomputes_and_keeps_tokens_identical():
    prompts = [[200 + 10 * i + j for j in range(30)] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = {}
    preemptions = {}
    for blocks in (200, 40):  # 40 blocks of 4: four requests cannot all grow at once
        engine = tiny_engine(num_kv_blocks=blocks)
        requests = [engine.add_request(f"p{i}", p, params) for i, p in enumerate(prompts)]
        outputs[blocks] = {k: v.token_ids for k, v in run_to_completion(engine).items()}
        preemptions[blocks] = sum(b.num_preemptions for r in requests for b in r.branches)
        assert_pool_clean(engine)
    assert preemptions[200] == 0 and preemptions[40] > 0
    assert outputs[200] == outputs[40]


def test_shared_prefix_is_reported_as_cached():
    engine = tiny_engine()
    system = list(range(300, 340))
    engine.add_request("a", system + [5, 6], SamplingParams(temperature=0, max_tokens=2))
    first = run_to_completion(engine)["a"]
    engine.add_request("b", system + [7, 8, 9], SamplingParams(temperature=0, max_tokens=2))
    second = run_to_completion(engine)["b"]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 40
    assert second.metrics.num_prefill_tokens == 3 and second.metrics.ttft > 0
    assert_pool_clean(engine)


def test_stop_conditions_and_n():
    engine = tiny_engine()

    def run(name: str, **params: object):
        settings = {"temperature": 0, "max_tokens": 8, "ignore_eos": True, **params}
        engine.add_request(name, [11, 12, 13], SamplingParams(**settings))
        return run_to_completion(engine)[name]

    free = run("free")
    assert len(free.token_ids) == 8 and free.outputs[0].finish_reason is FinishReason.LENGTH
    stop_at = free.token_ids[3]
    stopped = run("tok", stop_token_ids=[stop_at])
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(stop_at)]
    assert stopped.outputs[0].finish_reason is FinishReason.STOP
    text_stop = free.text[len(free.text) // 2 :][:3]
    if text_stop.strip():
        cut = run("txt", stop=[text_stop])
        assert cut.text == free.text[: free.text.find(text_stop)]
    forked = run("n", n=3, temperature=1.0, seed=5, max_tokens=5)
    assert [len(o.token_ids) for o in forked.outputs] == [5, 5, 5]
    assert len({tuple(o.token_ids) for o in forked.outputs}) > 1
    assert_pool_clean(engine)


def test_requests_that_can_never_run_are_rejected_with_both_numbers():
    engine = tiny_engine(num_kv_blocks=16, max_model_len=100)
    with pytest.raises(ValueError, match=r"100 tokens.*context is 100 tokens"):
        engine.add_request("long", list(range(100)), SamplingParams())
    with pytest.raises(CapacityError, match=r"needs 18 KV blocks; the pool has 16 blocks"):
        engine.add_request("big", list(range(70)), SamplingParams())
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 49152\)"):
        engine.add_request("bad", [1, 10**9], SamplingParams())
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("empty", [], SamplingParams())
    engine.add_request("ok", [1, 2, 3], SamplingParams(temperature=0, max_tokens=3))
    assert len(run_to_completion(engine)["ok"].token_ids) == 3  # still serving
    assert_pool_clean(engine)


def test_abort_frees_blocks_mid_generation():
    engine = tiny_engine()
    engine.add_request("x", list(range(50, 90)), SamplingParams(max_tokens=100, ignore_eos=True))
    engine.add_request("y", list(range(50, 60)), SamplingParams(max_tokens=3, ignore_eos=True))
    for _ in range(3):
        engine.step()
    final = engine.abort_request("x")
    assert final.finished and final.outputs[0].finish_reason is FinishReason.ABORT
    assert engine.abort_request("x") is None
    run_to_completion(engine)
    assert_pool_clean(engine)


def test_a_failed_step_aborts_its_requests_and_forgets_uncomputed_blocks(monkeypatch):
    engine = tiny_engine()
    engine.add_request("a", list(range(60, 90)), SamplingParams(max_tokens=4))
    original = engine.model.forward

    def broken(*args, **kwargs):
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(engine.model, "forward", broken)
    with pytest.raises(RuntimeError, match="simulated"):
        engine.step()
    assert_pool_clean(engine)
    assert engine.manager.match(list(range(60, 90))) == 0  # nothing half-written is reusable
    monkeypatch.setattr(engine.model, "forward", original)
    engine.add_request("b", list(range(60, 90)), SamplingParams(temperature=0, max_tokens=2))
    assert len(run_to_completion(engine)["b"].token_ids) == 2
