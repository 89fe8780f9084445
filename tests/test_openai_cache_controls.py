"""OpenAI's prompt-caching controls through the real SDK: ``prompt_cache_retention`` keeps a
tenant's prompt through another tenant's flood until it expires, within the tenant's
retention budget; ``prompt_cache_key`` reaches the trace as an id, never as the key."""

from __future__ import annotations

import json
import logging
import time

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import loopback
from clock_fixtures import FakeClock
from engine_fixtures import default_engine, tiny_engine
from prefixcache.cache.retention import DEFAULT_SHARE, Keep
from prefixcache.cli import build_parser
from prefixcache.protocol.auth import Tenants
from prefixcache.protocol.cache_controls import ANTHROPIC_TTLS, openai_keeps, openai_retention_class
from prefixcache.server.trace_out import TraceWriter
from server_fixtures import running_server, wait_idle

POOL_BLOCKS = 64  # of 4 tokens: 256 tokens, fewer than one flood
TENANTS = [
    {"name": "alpha", "keys": ["sk-alpha"], "admin": True},
    {"name": "beta", "keys": ["sk-beta"]},
    {"name": "gamma", "keys": ["sk-gamma"], "retention_budget": 0.1},
]
SYSTEM = "Heron ferry desk: answer timetable questions in one short sentence. " * 2
OTHER = "Lynx rail help line, platforms and delays only, be brief please. " * 2


@pytest.fixture
def served(tmp_path):
    """A tiny engine with a small pool and a fake retention clock, three tenants."""
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"tenants": TENANTS}))
    clock = FakeClock()
    tenants = Tenants.from_file(path)  # its budgets reach the engine as `serve` passes them
    engine = tiny_engine(
        num_kv_blocks=POOL_BLOCKS,
        retention_clock=clock,
        retention_budgets=tenants.retention_budgets(),
    )
    with running_server(engine, tenants) as (url, state):
        yield url, state, clock
        wait_idle(state)


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def ask(api: openai.OpenAI, system: str, question: str = "When?", **controls) -> int:
    """One chat; its cached prompt tokens."""
    reply = api.chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=2,
        temperature=0,
        extra_body={"ignore_eos": True},
        **controls,
    )
    return reply.usage.prompt_tokens_details.cached_tokens


def flood(url: str) -> None:
    """Tenant beta's distinct prompts: more tokens than the pool holds."""
    api = client(url, "sk-beta")
    for i in range(5):
        ask(api, f"Flood number {i} about cormorants and tides. " * 8)


def metric(url: str, name: str, **labels: str) -> float:
    """One sample of /metrics (admin key), 0.0 when absent."""
    text = loopback.get(url + "/metrics", headers={"Authorization": "Bearer sk-alpha"}).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def test_a_retained_prompt_survives_a_flood_until_it_expires(served):
    url, _, clock = served
    alpha = client(url, "sk-alpha")
    assert ask(alpha, SYSTEM, prompt_cache_retention="in_memory") == 0
    assert ask(alpha, OTHER) == 0  # unmarked: automatic caching only
    assert ask(alpha, OTHER) > 0  # cached until the flood
    assert metric(url, "prefixcache_retained_blocks", tenant="alpha", **{"class": "in_memory"}) > 0
    flood(url)
    kept = ask(alpha, SYSTEM, prompt_cache_retention="in_memory")  # a hit refreshes the mark
    assert kept >= len(SYSTEM) // 8  # the system prompt's blocks (a token is < 8 chars)
    assert ask(alpha, OTHER) == 0
    assert metric(url, "prefixcache_retention_saved_hits_total") > 0
    clock.now += 301  # in_memory is 300 s
    flood(url)
    assert ask(alpha, SYSTEM) == 0
    assert metric(url, "prefixcache_retention_expired_total") > 0
    assert metric(url, "prefixcache_retained_blocks", tenant="alpha", **{"class": "in_memory"}) == 0


def test_the_tenants_file_budget_caps_what_a_tenant_retains(served):
    url, _, _ = served
    ask(client(url, "sk-gamma"), SYSTEM * 2, prompt_cache_retention="24h")
    budget = int(0.1 * POOL_BLOCKS)
    assert metric(url, "prefixcache_retained_blocks", tenant="gamma", **{"class": "24h"}) == budget
    assert metric(url, "prefixcache_retention_refused_total") > 0
    ask(client(url, "sk-alpha"), SYSTEM * 2, prompt_cache_retention="24h")  # default share 0.5
    assert metric(url, "prefixcache_retained_blocks", tenant="alpha", **{"class": "24h"}) > budget


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("prompt_cache_retention", "1h", "'in_memory', '24h'"),
        ("prompt_cache_retention", 5, "'in_memory', '24h'"),
        ("prompt_cache_key", "k" * 257, "256"),
        ("prompt_cache_key", 7, "string"),
    ],
)
def test_bad_cache_controls_are_400s_naming_the_field(served, path, field, value, named):
    url = served[0]
    body = {"model": "tiny", "max_tokens": 2, field: value}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {})
    body.update({} if "chat" in path else {"prompt": "hi"})
    reply = loopback.post(url + path, json=body, headers={"Authorization": "Bearer sk-alpha"})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert field in error["message"] and named in error["message"]
    assert error["param"] == field


def test_the_dashed_spelling_and_null_are_accepted(served):
    url = served[0]
    alpha = client(url, "sk-alpha")
    ask(alpha, SYSTEM, prompt_cache_retention="in-memory")  # type: ignore[arg-type]
    assert metric(url, "prefixcache_retained_blocks", tenant="alpha", **{"class": "in_memory"}) > 0
    ask(alpha, OTHER, prompt_cache_retention=None, prompt_cache_key=None)
    client(url, "sk-alpha").completions.create(  # the SDK's completions lack the field
        model="tiny", prompt=OTHER, max_tokens=1, extra_body={"prompt_cache_retention": "24h"}
    )
    assert metric(url, "prefixcache_retained_blocks", tenant="alpha", **{"class": "24h"}) > 0


def test_the_cache_key_is_in_the_trace_as_an_id_and_in_the_log_as_a_digest(
    tmp_path, served, caplog
):
    url, state, _ = served
    path = tmp_path / "trace.jsonl"
    trace = TraceWriter(path, state.engine.manager)
    state.engine.on_retired.append(trace.record)  # the engine is idle between requests
    secret = "customer-1234-secret-key"
    with caplog.at_level(logging.INFO, "prefixcache.server"):
        ask(client(url, "sk-alpha"), SYSTEM, prompt_cache_key=secret)
        ask(client(url, "sk-beta"), SYSTEM, prompt_cache_key=secret)
        ask(client(url, "sk-alpha"), OTHER, prompt_cache_key=secret, prompt_cache_retention="24h")
        ask(client(url, "sk-alpha"), OTHER)
        wait_idle(state)
    trace.close()
    raw = path.read_text()
    assert secret not in raw
    lines = [json.loads(line) for line in raw.splitlines()]
    assert [line.get("cache_key") for line in lines] == [0, 1, 0, None]
    assert [line.get("retention") for line in lines] == [
        None,
        None,
        [[lines[2]["input_length"], 86400]],
        None,
    ]
    logged = [r.getMessage() for r in caplog.records if "status=" in r.getMessage()]
    assert len(logged) == 4 and not any(secret in line for line in logged)
    assert logged[0].count("cache_key=") == 1 and "cache_key=" not in logged[3]
    assert logged[0].split("cache_key=")[1][:12] == logged[2].split("cache_key=")[1][:12]
    assert logged[0].split("cache_key=")[1][:12] != logged[1].split("cache_key=")[1][:12]


def test_the_real_model_through_the_sdk_with_both_fields():
    engine = default_engine()
    with running_server(engine, Tenants(None), model_name="smollm2") as (url, state):
        api = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
        replies = [
            api.chat.completions.create(
                model="smollm2",
                messages=messages,
                max_tokens=2,
                temperature=0,
                prompt_cache_key="ferry-desk",
                prompt_cache_retention="in_memory",
            )
            for _ in range(2)
        ]
        wait_idle(state)
        deadline = time.monotonic() + 5
        while not state.engine.snapshot.retained and time.monotonic() < deadline:
            time.sleep(0.05)
        assert state.engine.snapshot.retained[0][:2] == ("local", "in_memory")
    assert replies[0].choices[0].message.content
    assert replies[1].usage.prompt_tokens_details.cached_tokens > 0
    engine.manager.reset()


def key_file(tmp_path, **budgets: object):
    path = tmp_path / "keys.json"
    entries = [{"name": n, "keys": [f"sk-{n}"], "retention_budget": b} for n, b in budgets.items()]
    path.write_text(json.dumps({"tenants": [*entries, {"name": "plain", "keys": ["sk-plain"]}]}))
    return path


def test_retention_budgets_of_the_tenants_file_and_the_flag(tmp_path):
    assert Tenants.from_file(key_file(tmp_path, A=0.25, B=0)).retention_budgets() == {
        "A": 0.25,
        "B": 0.0,
    }
    assert Tenants(None).retention_budgets() == {}
    parse = build_parser().parse_args
    assert parse(["serve"]).retention_budget == DEFAULT_SHARE
    assert parse(["serve", "--retention-budget", "0.2"]).retention_budget == 0.2


@pytest.mark.parametrize("value", [1.5, -0.1, "half", True])
def test_a_bad_retention_budget_is_refused_at_load_naming_the_tenant(tmp_path, value):
    with pytest.raises(ValueError, match=r"retention budget of 'A' must be a number in \[0, 1\]"):
        Tenants.from_file(key_file(tmp_path, A=value))


def test_a_bad_retention_budget_flag_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--retention-budget", "2"])
    err = capsys.readouterr().err
    assert "--retention-budget" in err and "[0, 1]" in err


def test_the_mapping_of_retention_names_to_keeps():
    assert openai_keeps(openai_retention_class("in-memory"), 40) == (Keep(40, 300, "in_memory"),)
    assert openai_keeps("24h", 7) == (Keep(7, 86400, "24h"),)
    assert openai_keeps(None, 40) == ()
    assert ANTHROPIC_TTLS == {"5m": 300, "1h": 3600}
    with pytest.raises(ValueError, match="must be one of 'in_memory', '24h', 'in-memory'"):
        openai_retention_class("5m")
