"""Priorities: the request field on every route, tenants' defaults and caps, and pauses of
a running prefill for a more urgent arrival (no work lost, the same greedy tokens)."""

from __future__ import annotations

import json

import httpx
import pytest

import loopback
from engine_fixtures import default_engine, run_to_completion, tiny_engine
from prefixcache import KVCacheManager
from prefixcache.engine.config import DEFAULT_STEP_TARGET_MS
from prefixcache.engine.sampling import SamplingParams
from prefixcache.engine.scheduler import Scheduler
from prefixcache.protocol.auth import Tenants
from server_fixtures import running_server
from test_scheduler import finish_all, make_request, run_step


def test_a_more_urgent_arrival_pauses_a_running_prefill_at_a_chunk_boundary():
    manager = KVCacheManager(num_blocks=256, block_size=16)
    scheduler = Scheduler(manager, max_num_seqs=1, max_num_batched_tokens=256, step_target=0.25)
    long = make_request("long", list(range(1000))).branches[0]
    scheduler.add(long)
    run_step(scheduler)  # 256 tokens: 16 blocks committed
    same = make_request("same", [5000] * 10)  # priority 0: no pause, it waits
    scheduler.add(same.branches[0])
    assert [c.branch for c in run_step(scheduler)] == [long]
    urgent = make_request("urgent", [7000] * 10)
    urgent.priority = -1
    scheduler.add(urgent.branches[0])
    committed = long.seq.num_computed_tokens // 16 * 16  # its full blocks so far
    (chunk,) = run_step(scheduler)
    assert chunk.branch is urgent.branches[0] and long.seq is None and long.num_pauses == 1
    assert scheduler.last_waits["priority"] == 1  # long: paused for more urgent work
    assert scheduler.num_pauses == 1 and manager.match(long.token_ids) == committed > 0  # cached
    scheduler.finish(urgent.branches[0])
    (chunk,) = run_step(scheduler)
    assert chunk.branch is same.branches[0]  # the shortest waiting work first
    scheduler.finish(same.branches[0])
    resumed = [c for c in run_step(scheduler) if c.branch is long]
    assert resumed and resumed[0].start == committed  # its blocks, reused
    finish_all(scheduler)


def test_a_paused_request_completes_with_the_same_greedy_tokens():
    engine = default_engine()
    prompt = engine.tokenizer.encode("The history of the printing press: " * 24)[:200]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request("alone", prompt, greedy)
    expected = run_to_completion(engine)["alone"].token_ids
    engine.manager.reset()
    scheduler = engine.scheduler
    knobs = scheduler.max_num_seqs, scheduler.max_num_batched_tokens, scheduler.step_target
    scheduler.max_num_seqs, scheduler.max_num_batched_tokens = 1, 64  # chunks of 4 blocks
    scheduler.step_target = DEFAULT_STEP_TARGET_MS / 1e3  # pauses are the timed path's
    try:
        paused = engine.add_request("paused", prompt, greedy)
        engine.step()
        engine.add_request("urgent", prompt[:20], greedy, priority=-5)
        engine.step()
        assert paused.branches[0].num_pauses == 1 and paused.branches[0].seq is None
        finals = run_to_completion(engine)
    finally:
        scheduler.max_num_seqs, scheduler.max_num_batched_tokens, scheduler.step_target = knobs
    assert finals["paused"].token_ids == expected
    assert paused.metrics.num_prefill_tokens == len(prompt)  # the pause lost no work
    assert finals["urgent"].metrics.first_token_time < finals["paused"].metrics.first_token_time


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("keys")
    path = folder / "keys.json"
    tenants = [
        {"name": "open", "keys": ["sk-open"], "admin": True},
        {"name": "batch", "keys": ["sk-batch"], "priority": 5, "min_priority": 0},
    ]
    path.write_text(json.dumps({"tenants": tenants}))
    engine = tiny_engine(num_kv_blocks=200, step_target_ms=DEFAULT_STEP_TARGET_MS)
    seen = []
    engine.on_retired.append(lambda request: seen.append(request.priority))
    with running_server(engine, Tenants.from_file(path)) as (url, _):
        yield url, seen


ROUTES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/responses": {"input": "hi", "max_output_tokens": 2},
    "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
}


def post(url: str, path: str, key: str, **fields) -> httpx.Response:
    body = {"model": "tiny", **ROUTES[path], **fields}
    return loopback.post(url + path, json=body, headers={"authorization": f"Bearer {key}"})


@pytest.mark.parametrize("path", list(ROUTES))
def test_every_route_takes_a_priority_and_refuses_a_bad_one(served, path):
    url, seen = served
    seen.clear()
    assert post(url, path, "sk-open", priority=-7).status_code == 200
    assert post(url, path, "sk-batch").status_code == 200  # the tenant's default
    assert seen == [-7, 5]
    for bad in (1001, "high", 1.5, True):
        response = post(url, path, "sk-open", priority=bad)
        assert response.status_code == 400, bad
        text = json.dumps(response.json())
        assert "priority" in text and ("1000" in text or "integer" in text)
    response = post(url, path, "sk-batch", priority=-1)
    assert response.status_code == 400
    assert "min_priority 0" in json.dumps(response.json())


def test_a_tenants_file_with_a_bad_priority_is_refused(tmp_path):
    path = tmp_path / "keys.json"
    entry = {"name": "x", "keys": ["k"], "priority": -3, "min_priority": 0}
    path.write_text(json.dumps({"tenants": [entry]}))
    with pytest.raises(ValueError, match="priority -3 is below its min_priority 0"):
        Tenants.from_file(path)


def test_metrics_show_step_times_against_the_target_and_pauses(served):
    url, _ = served
    assert post(url, "/v1/completions", "sk-open").status_code == 200
    text = loopback.get(url + "/metrics", headers={"authorization": "Bearer sk-open"}).text  # admin
    samples = dict(
        line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#")
    )
    assert float(samples["prefixcache_step_seconds_count"]) >= 2  # prefill + a decode at least
    assert float(samples['prefixcache_step_seconds_bucket{le="+Inf"}']) == float(
        samples["prefixcache_step_seconds_count"]
    )
    assert float(samples["prefixcache_step_target_seconds"]) == DEFAULT_STEP_TARGET_MS / 1e3
    assert 'prefixcache_prefill_pauses_total{cause="priority"}' in samples
    assert 'prefixcache_interleaved_steps_total{kind="urgent"}' in samples
    assert 'prefixcache_queue_seconds_total{reason="seats"}' in samples


def test_a_pause_for_room_in_the_pool_does_not_readmit_the_paused_one_at_once():
    manager = KVCacheManager(num_blocks=20, block_size=16)
    scheduler = Scheduler(manager, max_num_batched_tokens=64, step_target=0.25)
    long = make_request("long", list(range(300))).branches[0]
    scheduler.add(long)
    run_step(scheduler)  # admitted with 19 blocks, 64 tokens computed
    urgent = make_request("urgent", [7000] * 40)
    urgent.priority = -1
    scheduler.add(urgent.branches[0])
    chunks = run_step(scheduler)
    assert [c.branch for c in chunks] == [urgent.branches[0]]
    assert long.seq is None and long in scheduler.waiting and scheduler.num_pauses == 1
    assert scheduler.last_waits["priority"] == 1
    scheduler.finish(urgent.branches[0])
    while not long.output.token_ids:
        run_step(scheduler)
    assert long.num_pauses == 1  # resumed once the urgent one left, and completed
    finish_all(scheduler)
