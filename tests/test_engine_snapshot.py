"""The engine's published snapshot: what /metrics reads, and only that, from other threads."""

from __future__ import annotations

import threading
import time
from dataclasses import FrozenInstanceError

import pytest
from prometheus_client.parser import text_string_to_metric_families

import loopback
from engine_fixtures import assert_pool_clean, run_to_completion, tiny_engine
from prefixcache.engine.engine import LLMEngine
from prefixcache.engine.sampling import SamplingParams
from prefixcache.engine.snapshot import take_snapshot
from prefixcache.protocol.auth import Tenants
from prefixcache.server.metrics import ServerMetrics
from server_fixtures import running_server, wait_idle

GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
PROMPT = list(range(100, 140))  # 10 blocks of 4
LIVE = ("manager", "scheduler", "tier")  # what only the engine thread may read


class Untouchable:
    """Stands in for live engine state: any attribute read fails the test."""

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"live engine state read off the engine thread: .{name}")


class EngineThreadOnly:
    """Forwards to ``target``; notes every other thread that reaches it."""

    def __init__(self, target: object, strangers: set[str]) -> None:
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_strangers", strangers)

    def __getattr__(self, name: str) -> object:
        self._note()
        return getattr(self._target, name)

    def __setattr__(self, name: str, value: object) -> None:
        self._note()
        setattr(self._target, name, value)

    def _note(self) -> None:
        thread = threading.current_thread().name
        if thread != "engine":
            self._strangers.add(thread)


def samples(text: str) -> dict[str, float]:
    """Unlabelled samples and the tier's (labels dropped), by name."""
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels or set(sample.labels) <= {"model_name", "medium"}
    }


def scrape(metrics: ServerMetrics) -> dict[str, float]:
    return samples(metrics.render().decode())


def test_the_snapshot_is_frozen_plain_numbers():
    engine = tiny_engine()
    snapshot = engine.snapshot
    assert (snapshot.num_blocks, snapshot.num_free_blocks, snapshot.block_size) == (64, 64, 4)
    assert snapshot.owners == () and snapshot.tier is None
    with pytest.raises(FrozenInstanceError):
        snapshot.hits = 1  # type: ignore[misc]
    assert not hasattr(snapshot, "__dict__")  # slots


def test_values_move_only_when_a_snapshot_is_published():
    engine = tiny_engine()
    metrics = ServerMetrics(engine, "tiny")
    before = scrape(metrics)
    engine.add_request("r", PROMPT, GREEDY)
    run_to_completion(engine)  # no engine thread here: nothing publishes
    assert scrape(metrics) == before
    engine.publish_snapshot()
    after = scrape(metrics)
    assert after["prefixcache_prefix_cache_queries_tokens_total"] == len(PROMPT)
    assert after["vllm:prefix_cache_queries_total"] == len(PROMPT)
    assert after["prefixcache_kv_free_blocks"] == 64


def test_the_scrape_never_reads_the_manager_scheduler_or_tier(tmp_path):
    engine = tiny_engine(kv_tier=f"disk:{tmp_path}", owner_shares={})
    engine.add_request("r", PROMPT, GREEDY, owner="A")
    finals = run_to_completion(engine)
    engine.publish_snapshot()
    metrics = ServerMetrics(engine, "tiny")
    expected = metrics.render()
    live = {name: getattr(engine, name) for name in LIVE}
    try:
        for name in LIVE:
            setattr(engine, name, Untouchable())
        assert metrics.render() == expected
        metrics.observe("A", finals["r"], "salt")  # per-request metrics read the snapshot too
    finally:
        for name, value in live.items():
            setattr(engine, name, value)
        engine.close()
    text = metrics.render().decode()
    assert 'prefixcache_tenant_cached_blocks{tenant="A"}' in text
    assert 'prefixcache_tier_writes_total{medium="disk"}' in text
    assert_pool_clean(engine)


def test_per_owner_usage_is_counted_in_every_snapshot():
    engine = tiny_engine(owner_shares={})
    engine.add_request("a", PROMPT, GREEDY, owner="A")
    run_to_completion(engine)
    first = take_snapshot(engine)
    engine.add_request("b", list(range(200, 240)), GREEDY, owner="A")
    run_to_completion(engine)
    second = take_snapshot(engine)
    assert second.owners[0].cached_blocks > first.owners[0].cached_blocks
    assert second.queries == first.queries + 40
    assert_pool_clean(engine)


def _complete(url: str, prompt: list[int]) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0}
    reply = loopback.post(f"{url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_metrics_are_current_when_the_response_arrives():
    engine = tiny_engine()
    with running_server(engine, Tenants(None)) as (url, state):
        strangers: set[str] = set()
        live = {name: getattr(engine, name) for name in LIVE[:2]}
        for name, value in live.items():
            setattr(engine, name, EngineThreadOnly(value, strangers))
        try:
            before = samples(loopback.get(f"{url}/metrics").text)
            _complete(url, PROMPT)
            after = samples(loopback.get(f"{url}/metrics").text)  # no wait: published already
            _complete(url, PROMPT)
            again = samples(loopback.get(f"{url}/metrics").text)
            wait_idle(state)
        finally:
            for name, value in live.items():
                setattr(engine, name, value)
    assert strangers == set()  # only the engine thread reached the manager and scheduler
    queries = "prefixcache_prefix_cache_queries_tokens_total"
    assert after[queries] == before[queries] + len(PROMPT)
    assert (after["prefixcache_requests_running"], after["prefixcache_kv_free_blocks"]) == (0, 64)
    assert after["prefixcache_reusable_tokens_per_request_count"] == 1
    assert again["prefixcache_prefix_cache_hits_tokens_total"] > 0
    assert (
        again["vllm:prefix_cache_hits_total"] == again["prefixcache_prefix_cache_hits_tokens_total"]
    )
    assert_pool_clean(engine)


def test_an_idle_engine_republishes_its_tier_numbers(tmp_path):
    engine: LLMEngine = tiny_engine(num_kv_blocks=200, kv_tier=f"disk:{tmp_path}")
    with running_server(engine, Tenants(None)) as (url, state):
        _complete(url, PROMPT)
        wait_idle(state)
        assert engine.tier.client.flush(timeout=10)
        written = engine.tier.client.stats.writes  # by the tier's writer thread, after the step
        assert written > 0
        deadline = time.monotonic() + 10
        while (
            samples(loopback.get(f"{url}/metrics").text)["prefixcache_tier_writes_total"] < written
        ):
            assert time.monotonic() < deadline, "the idle engine never republished"
            time.sleep(0.1)
    engine.close()


def test_the_pool_by_state_adds_up_to_the_pool():
    engine = tiny_engine()
    engine.add_request("r", PROMPT, GREEDY)
    run_to_completion(engine)
    engine.publish_snapshot()
    families = text_string_to_metric_families(ServerMetrics(engine, "tiny").render().decode())
    by_state = {
        sample.labels["state"]: sample.value
        for family in families
        if family.name == "prefixcache_kv_blocks_by_state"
        for sample in family.samples
    }
    # 40 prompt tokens + 2 computed outputs: 10 full blocks cached, the 11th freed empty
    assert by_state == {"running": 0, "cached": 10, "retained": 0, "free": 54}
    assert_pool_clean(engine)
