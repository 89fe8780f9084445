"""The HTTP server on loopback, driven by the official openai client and raw httpx."""

from __future__ import annotations

import asyncio
import random
import socket
import time

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import loopback
from engine_fixtures import assert_pool_clean, tiny_engine
from prefixcache.protocol.auth import Tenants
from prefixcache.protocol.limits import Limits
from server_fixtures import running_server, wait_idle, write_key_file

SYSTEM = "Zebra railway assistant: answer carefully and briefly. " * 6


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    engine = tiny_engine(num_kv_blocks=400, block_size=4, max_num_seqs=16)
    tenants = Tenants.from_file(write_key_file(tmp_path_factory.mktemp("keys")))
    with running_server(engine, tenants) as (url, state):
        yield url, state


def client(url: str, key: str = "sk-alpha") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def ask(url: str, key: str, question: str, **extra):
    return client(url, key).chat.completions.create(
        model="tiny",
        max_tokens=4,
        temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        extra_body={"ignore_eos": True, **extra.pop("extra_body", {})},
        **extra,
    )


def test_chat_and_completions_streaming_and_not(served):
    url, state = served
    api = client(url)
    chat = api.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 5
    chunks = list(
        api.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == chat.choices[0].message.content
    assert (
        chunks[-1].usage.completion_tokens == 5 and chunks[0].choices[0].delta.role == "assistant"
    )
    text = api.completions.create(
        model="tiny",
        prompt="One two three",
        max_tokens=4,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    pieces = api.completions.create(
        model="tiny",
        prompt="One two three",
        max_tokens=4,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(p.choices[0].text for p in pieces) == text.choices[0].text
    two = api.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        n=2,
        max_tokens=6,
        temperature=1.0,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in two.choices] == [0, 1] and two.usage.completion_tokens == 12
    assert [m.id for m in api.models.list().data] == ["tiny"]
    wait_idle(state)


def test_cached_tokens_are_shared_within_a_tenant_only(served):
    url, state = served
    assert ask(url, "sk-alpha", "First question?").usage.prompt_tokens_details.cached_tokens == 0
    again = ask(url, "sk-alpha", "Second question?")
    assert again.usage.prompt_tokens_details.cached_tokens > 40
    assert ask(url, "sk-beta", "Second question?").usage.prompt_tokens_details.cached_tokens == 0
    narrowed = ask(url, "sk-alpha", "Third?", extra_body={"cache_salt": "team-x"})
    assert narrowed.usage.prompt_tokens_details.cached_tokens == 0
    for question in ("Private one?", "Private two?"):
        private = ask(url, "sk-private", question)
        assert private.usage.prompt_tokens_details.cached_tokens == 0
    wait_idle(state)


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b"{not json", 400, "request body is not valid JSON"),
        (b'{"model": "tiny"}', 400, "messages: Field required"),
        (
            b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": 5}',
            400,
            "temperature: Input should be less than or equal to 2",
        ),
        (
            b'{"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}',
            400,
            "messages.0.role",
        ),
        (
            b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], '
            b'"functions": [{"name": "f"}]}',
            400,
            "functions is not supported",
        ),
        (
            b'{"model": "other", "messages": [{"role": "user", "content": "x"}]}',
            404,
            "model 'other' does not exist",
        ),
        (
            b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], '
            b'"max_tokens": 9000}',
            400,
            "context is 512 tokens",
        ),
    ],
)
def test_bad_requests_get_clear_errors(served, body, status, message):
    url, _ = served
    response = loopback.post(
        url + "/v1/chat/completions", content=body, headers={"authorization": "Bearer sk-alpha"}
    )
    assert response.status_code == status
    assert message in response.json()["error"]["message"]
    assert response.json()["error"]["type"]


def test_prompts_too_long_for_context_or_pool(served, tmp_path):
    url, _ = served
    response = loopback.post(
        url + "/v1/completions",
        headers={"authorization": "Bearer sk-alpha"},
        json={"model": "tiny", "prompt": list(range(600)), "max_tokens": 1},
    )
    assert response.status_code == 400 and "512" in response.json()["error"]["message"]
    engine = tiny_engine(num_kv_blocks=10, block_size=4)
    with running_server(engine, Tenants(None)) as (small_url, _):
        response = loopback.post(
            small_url + "/v1/completions",
            json={"model": "tiny", "prompt": list(range(60)), "max_tokens": 1},
        )
    assert response.status_code == 400
    assert "needs 16 KV blocks; the pool has 10 blocks" in response.json()["error"]["message"]


def test_keys_are_required_and_checked(served):
    url, _ = served
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
    missing = loopback.post(url + "/v1/chat/completions", json=body)
    wrong = loopback.post(
        url + "/v1/chat/completions", json=body, headers={"authorization": "Bearer sk-nope"}
    )
    assert (missing.status_code, wrong.status_code) == (401, 401)
    assert "missing API key" in missing.json()["error"]["message"]
    not_admin = loopback.post(
        url + "/admin/reset_prefix_cache", headers={"authorization": "Bearer sk-beta"}
    )
    assert not_admin.status_code == 403


def test_admin_reset_reports_honestly(served):
    url, state = served
    ask(url, "sk-alpha", "Warm the cache?")
    wait_idle(state)
    admin = {"authorization": "Bearer sk-alpha"}
    done = loopback.post(url + "/admin/reset_prefix_cache", headers=admin).json()
    assert done["reset"] is True
    assert ask(url, "sk-alpha", "Cold again?").usage.prompt_tokens_details.cached_tokens == 0

    async def reset_while_busy():
        async with loopback.AsyncClient(base_url=url, headers=admin, timeout=60) as http:
            body = {"model": "tiny", "prompt": "long", "max_tokens": 300, "ignore_eos": True}
            busy = asyncio.create_task(http.post("/v1/completions", json=body))
            while not state.engine.scheduler.running:  # admitted: it holds blocks now
                await asyncio.sleep(0.01)
            refused = (await http.post("/admin/reset_prefix_cache")).json()
            await busy
            return refused

    refused = asyncio.run(reset_while_busy())
    assert refused["reset"] is False and "in use" in refused["detail"]
    wait_idle(state)


def test_overload_gets_429_not_an_unbounded_queue():
    engine = tiny_engine()
    with running_server(engine, Tenants(None), max_pending=2) as (url, state):

        async def burst():
            async with loopback.AsyncClient(base_url=url, timeout=60) as http:
                body = {"model": "tiny", "prompt": "x y z", "max_tokens": 200, "ignore_eos": True}
                return await asyncio.gather(
                    *(http.post("/v1/completions", json=body) for _ in range(6))
                )

        statuses = sorted(r.status_code for r in asyncio.run(burst()))
        wait_idle(state)
    assert statuses.count(200) >= 2 and 429 in statuses and set(statuses) <= {200, 429}
    assert_pool_clean(engine)


def test_bodies_still_arriving_count_against_max_pending():
    """Without tenants too: at most --max-pending bodies are buffered at once."""
    engine = tiny_engine()
    limits = Limits(request_read_timeout=10.0)
    with running_server(engine, Tenants(None), max_pending=2, limits=limits) as (url, state):
        port = int(url.rsplit(":", 1)[1])
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
        )
        slow = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        for sock in slow:
            sock.sendall(head)  # a body that is still arriving
        deadline = time.monotonic() + 10
        while state.in_flight.total < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        body = {"model": "tiny", "prompt": "x", "max_tokens": 1}
        refused = loopback.post(url + "/v1/completions", json=body, timeout=10)
        for sock in slow:
            sock.close()
        wait_idle(state)
        served_after = loopback.post(url + "/v1/completions", json=body, timeout=10)
    assert refused.status_code == 429 and "--max-pending" in refused.json()["error"]["message"]
    assert refused.headers["retry-after"] == "1"
    assert served_after.status_code == 200
    assert_pool_clean(engine)


def test_load_with_random_disconnects_leaves_every_block_free(served):
    url, state = served
    rng = random.Random(0)
    prefixes = [f"Shared context number {i}. " * 5 for i in range(4)]

    async def one(api: openai.AsyncOpenAI, index: int) -> str:
        stream = await api.chat.completions.create(
            model="tiny",
            stream=True,
            max_tokens=rng.randrange(2, 12),
            temperature=0,
            messages=[
                {"role": "system", "content": rng.choice(prefixes)},
                {"role": "user", "content": f"question {index}"},
            ],
            extra_body={"ignore_eos": True},
        )
        disconnect = rng.random() < 0.25
        async for _ in stream:
            if disconnect:
                await stream.close()  # the client goes away mid-stream
                return "disconnected"
        return "ok"

    async def load() -> list[str]:
        api = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-beta", max_retries=0)
        gate = asyncio.Semaphore(32)

        async def limited(index: int) -> str:
            async with gate:
                return await one(api, index)

        return await asyncio.gather(*(limited(i) for i in range(240)))

    results = asyncio.run(load())
    assert set(results) <= {"ok", "disconnected"} and results.count("disconnected") > 20
    wait_idle(state)
    assert_pool_clean(state.engine)
    assert state.engine.manager.stats.hits > 0


def test_metrics_parse_and_move(served):
    url, state = served

    admin = {"authorization": "Bearer sk-alpha"}  # with a key file, /metrics is admin-only

    def scrape() -> dict[str, float]:
        text = loopback.get(url + "/metrics", headers=admin).text
        return {
            sample.name: sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if not sample.labels
        }

    before = scrape()
    ask(url, "sk-alpha", "Metrics question one?")
    ask(url, "sk-alpha", "Metrics question two?")
    wait_idle(state)
    after = scrape()
    grew = after["prefixcache_prefix_cache_queries_tokens_total"]
    assert grew > before["prefixcache_prefix_cache_queries_tokens_total"]
    assert (
        after["prefixcache_prefix_cache_hits_tokens_total"]
        > before["prefixcache_prefix_cache_hits_tokens_total"]
    )
    assert after["prefixcache_reusable_tokens_per_request_count"] >= 2
    assert after["prefixcache_kv_free_blocks"] == state.engine.manager.num_blocks
    for name in (
        "prefixcache_kv_free_blocks_low_watermark",
        "prefixcache_kv_evictions_total",
        "prefixcache_prefill_tokens_saved_total",
        "prefixcache_kv_duplicate_blocks_total",
        "prefixcache_shared_prefix_below_one_block_total",
        "prefixcache_cache_lookup_seconds_count",
    ):
        assert name in after
    assert "railway" not in loopback.get(url + "/metrics", headers=admin).text  # no prompt text
