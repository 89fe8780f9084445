"""Nothing a client sends stalls, crashes or starves the server (issue 10): limits, malformed
input, auth on the dispatched route, slow clients, and the event loop kept free."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

import loopback
from engine_fixtures import assert_pool_clean, tiny_engine
from prefixcache.protocol.auth import Tenants
from prefixcache.protocol.limits import DEFAULT_MAX_BODY_BYTES, Limits
from prefixcache.server.cli import serve_metrics
from raw_http import closed_by_server, connect, exchange, head, read_reply
from server_fixtures import free_port, running_server, wait_idle, write_key_file

ADMIN = {"authorization": "Bearer sk-alpha"}
BETA = {"authorization": "Bearer sk-beta"}
SMALL = Limits(max_body_bytes=64 * 1024, request_read_timeout=1.0, max_pending_per_tenant=2)


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """A server with a key file and small limits (64 KiB bodies, 1 s to read, 2 per tenant)."""
    engine = tiny_engine(num_kv_blocks=256, max_num_seqs=8)
    tenants = Tenants.from_file(write_key_file(tmp_path_factory.mktemp("keys")))
    with running_server(engine, tenants, max_pending=6, limits=SMALL) as (url, state):
        yield url, state


@pytest.fixture(scope="module")
def default(tmp_path_factory):
    """A server with the default limits and one local tenant."""
    engine = tiny_engine(num_kv_blocks=256, max_num_seqs=8)
    with running_server(engine, Tenants(None)) as (url, state):
        yield url, state


def wait_for(condition, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


@pytest.fixture(autouse=True)
def clean_after(request):
    """After every test: nothing in flight, every block back, the invariants hold."""
    yield
    for name in ("keyed", "default"):
        if name in request.fixturenames:
            _, state = request.getfixturevalue(name)
            wait_idle(state)  # which includes every tenant's share and the prepare pool
            assert_pool_clean(state.engine)


def post(url: str, path: str, body: bytes, headers: dict | None = None) -> httpx.Response:
    headers = {"content-type": "application/json", **(headers or {})}
    return loopback.post(url + path, content=body, headers=headers, timeout=60)


def test_the_two_inputs_of_the_issue_get_clear_errors_at_once(default):
    url, state = default
    with connect(url) as sock:  # 20 MB declared: refused before one byte of it is sent
        sock.sendall(head("POST", "/v1/completions", {"Content-Length": str(20_000_000)}))
        reply = read_reply(sock)
    assert reply.status == 413 and reply.headers["connection"] == "close"
    assert (
        f"larger than {DEFAULT_MAX_BODY_BYTES} bytes (--max-body-bytes)" in reply.error()["message"]
    )
    surrogate = post(url, "/v1/completions", b'{"model": "tiny", "prompt": "\\ud800 hi"}')
    assert surrogate.status_code == 400
    assert surrogate.json()["error"] == {
        "message": "prompt: contains a lone UTF-16 surrogate (not valid Unicode)",
        "type": "invalid_request_error",
        "param": "prompt",
        "code": None,
    }
    words = json.dumps({"model": "tiny", "prompt": "word " * 800_000}).encode()  # 4 MB
    refused = post(url, "/v1/completions", words)
    context = state.prepare.context
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt"
    assert f"4000000 characters; at most {state.prepare.max_prompt_chars}" in refused.text
    assert f"context of {context} tokens" in refused.text


def test_health_answers_while_a_big_body_is_being_prepared(default):
    url, state = default
    chars = state.prepare.max_prompt_chars
    prompts = ["word " * (chars // 5)] * 64  # 2.6 MB that must be tokenized to be refused
    big = json.dumps({"model": "tiny", "prompt": prompts}).encode()
    result: dict = {}
    caller = threading.Thread(target=lambda: result.update(r=post(url, "/v1/completions", big)))
    with loopback.Client(base_url=url, timeout=30) as http:
        idle = [_timed(http, "/health")[1] for _ in range(5)]
        caller.start()
        wait_for(lambda: state.pool.busy > 0 or not caller.is_alive())
        during = [(state.pool.busy > 0, *_timed(http, "/health")) for _ in range(5)]
    caller.join(timeout=60)
    print(f"/health idle {max(idle):.4f} s; while preparing (busy, status, s): {during}")
    assert during[0][:2] == (True, 200), "the big request finished before /health answered"
    assert all(status == 200 for _, status, _ in during)
    assert result["r"].status_code == 400
    assert "tokens; this model's context is" in result["r"].json()["error"]["message"]


def _timed(http: httpx.Client, path: str) -> tuple[int, float]:
    started = time.perf_counter()
    status = http.get(path).status_code
    return status, time.perf_counter() - started


def test_encode_off_the_gil_gives_the_tokenizers_ids(default):
    _, state = default
    tokenizer = state.prepare.tokenizer
    texts = ["Hello, world!", "  spaces\tand\nnewlines ", "漢字 and émojis 🙂", "-" * 500]
    for special in (False, True):
        # Tokenizer.encode runs encode_batch, which releases the GIL: the ids must not change
        for text in texts:
            ids = tokenizer.backend.encode(text, add_special_tokens=special).ids
            assert tokenizer.encode(text, special) == ids


USER = [{"role": "user", "content": "hi"}]


def _chat(**fields) -> bytes:
    return json.dumps({"model": "tiny", "messages": USER, "max_tokens": 2, **fields}).encode()


def _text(**fields) -> bytes:
    return json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 2, **fields}).encode()


CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
MALFORMED = [
    (TEXT, b'{"model": "tiny", "prompt": "\xff\xfe"}', "not valid JSON: 'utf-8' codec"),
    (TEXT, b'{"model": "tiny", "prompt": "x", "temperature": NaN}', "NaN is not a JSON number"),
    (TEXT, b'{"model": "tiny", "prompt": "x", "top_p": Infinity}', "Infinity is not a JSON"),
    (TEXT, b'{"model": "tiny", "prompt": "x", "top_p": -Infinity}', "Infinity is not a JSON"),
    (TEXT, b'{"model": "tiny", "prompt": "x", "temperature": 1e999}', "'1e999' is out of range"),
    (TEXT, b'{"model": "tiny", "prompt": "x", "seed": ' + b"9" * 40 + b"}", "at most 20 allowed"),
    (TEXT, b'{"model": "tiny", "prompt": ' + b"[" * 40 + b"]" * 40 + b"}", "deeper than 32"),
    (TEXT, b'{"model": "tiny", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", "deeper than 32"),
    (TEXT, b'{"model": "tiny", "x": [' + b",".join([b"[]"] * 17000) + b"]}", "more than 16384"),
    (CHAT, _chat(messages=[{"role": "user", "content": "\ud800"}]), "messages.0.content: contains"),
    (TEXT, b'{"model": "tiny", "prompt": "x", "\\udfff": 1}', "key with a lone UTF-16"),
    (TEXT, b"[1, 2]", "request body must be a JSON object"),
    (TEXT, b"", "not valid JSON"),
    (TEXT, b'"just a string"', "must be a JSON object"),
    (TEXT, _text(model=5), "model: Input should be a valid string"),
    (CHAT, _chat(messages="hi"), "messages: Input should be a valid list"),
    (CHAT, _chat(messages=[]), "messages: List should have at least 1 item"),
    (CHAT, _chat(messages=USER * 2049), "messages: List should have at most 2048 items"),
    (CHAT, _chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}] * 257}]),
     "257 parts; at most 256 allowed"),
    (CHAT, _chat(messages=[{"role": "user", "content": [{"type": "input_audio"}]}]),
     "part 0 is 'input_audio': only text parts"),
    (CHAT, _chat(messages=[{"role": "user", "content": [{"type": "x" * 500}]}]),
     "xxx...: only text parts"),
    (CHAT, _chat(n="two"), "n: Input should be a valid integer"),
    (CHAT, _chat(n=17), "n: Input should be less than or equal to 16"),
    (CHAT, _chat(stop=["a", "b", "c", "d", "e"]), "at most 4 non-empty strings"),
    (CHAT, _chat(stop=[""]), "at most 4 non-empty strings"),
    (CHAT, _chat(max_tokens=10**12), "context is 512 tokens"),
    (CHAT, _chat(seed=2**64), "seed: Input should be less than or equal to 18446744073709551615"),
    (CHAT, _chat(temperature="hot"), "temperature: Input should be a valid number"),
    (CHAT, _chat(logit_bias=[1]), "logit_bias: Input should be a valid dictionary"),
    (CHAT, _chat(stream_options=5), "stream_options: Input should be a valid dictionary"),
    (TEXT, _text(prompt=""), "prompt: prompt 0 is empty"),
    (TEXT, _text(prompt=[-1, 5]), "token id -1 is negative"),
    (TEXT, _text(prompt=[[3], [-7]]), "token id -7 is negative"),
    (TEXT, _text(prompt=[49152]), "token id 49152 is outside the vocabulary [0, 49152)"),
    (TEXT, _text(prompt=[10**19], echo=True), "outside the vocabulary"),
    (TEXT, _text(prompt=list(range(600))), "prompt 0 has 600 tokens"),
    (TEXT, _text(prompt="-" * 1_000_000), "1000000 characters; at most"),
    (TEXT, _text(model=""), "model '' does not exist"),
    (TEXT, _text(model="m" * 300), "model: String should have at most 256 characters"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "expected"), MALFORMED)
def test_malformed_input_is_a_4xx_error_object(default, path, body, expected):
    url, _ = default
    reply = post(url, path, body)
    assert 400 <= reply.status_code < 500, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert expected in error["message"], error["message"]
    assert "Traceback" not in reply.text


def test_unknown_fields_are_accepted_and_ignored_empty_content_too(default):
    url, _ = default
    extra = {"metadata": {"a": "b"}, "store": False, "parallel_tool_calls": True, "x_y": [1]}
    reply = post(url, CHAT, _chat(**extra))
    assert reply.status_code == 200, reply.text
    empty = [{"role": "system", "content": ""}, {"role": "user", "content": None}]
    assert post(url, CHAT, _chat(messages=empty)).status_code == 200


def test_bodies_over_the_limit_are_cut_off_declared_or_chunked(keyed):
    url, _ = keyed
    limit = SMALL.max_body_bytes
    declared = exchange(url, head("POST", TEXT, {**ADMIN, "Content-Length": str(limit + 1)}))
    assert declared.status == 413 and f"larger than {limit} bytes" in declared.error()["message"]
    with connect(url) as sock:  # chunked, no length: cut off once past the limit
        sock.sendall(head("POST", TEXT, {**ADMIN, "Transfer-Encoding": "chunked"}))
        chunk = b"x" * 8192
        sent = 0
        while sent <= limit:
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            sent += len(chunk)
        reply = read_reply(sock)
    assert reply.status == 413 and reply.headers["connection"] == "close"
    under = post(url, TEXT, _text(prompt="y" * (limit // 2)), ADMIN)  # read, then tokenized
    assert under.status_code == 400 and "tokens; this model's context is 512" in under.text


def test_a_slow_body_is_cut_off_at_the_deadline_holding_no_engine_slot(keyed):
    url, state = keyed
    with connect(url) as sock:
        sock.sendall(head("POST", TEXT, {**ADMIN, "Content-Length": "100"}) + b'{"model":')
        wait_for(lambda: state.in_flight.held("alpha") == 1)  # the guard awaits the body
        assert state.async_engine.num_pending == 0 and not state.engine.requests
        reply = read_reply(sock)
        assert closed_by_server(sock)
    assert reply.status == 408
    assert "body not received within 1 s (--request-read-timeout)" in reply.error()["message"]


def test_slowloris_heads_and_silent_connections_are_cut_off(keyed):
    url, _ = keyed
    request = head("GET", "/v1/models", ADMIN)
    with connect(url) as sock:
        stop = threading.Event()
        dripped = [0]

        def drip() -> None:  # one byte every 50 ms: the whole head would take ~4 s
            for byte in request:
                if stop.wait(0.05):
                    return
                try:
                    sock.send(bytes([byte]))
                except OSError:
                    return
                dripped[0] += 1

        dripper = threading.Thread(target=drip)
        dripper.start()
        reply = read_reply(sock)
        stop.set()
        dripper.join()
    assert reply.status == 408 and dripped[0] < len(request)
    assert "head not received within 1 s" in reply.error()["message"]
    with connect(url) as silent:
        assert read_reply(silent).status == 408 and closed_by_server(silent)


def test_too_many_or_too_large_headers_are_431(keyed):
    url, _ = keyed
    many = {f"x-h{i}": "1" for i in range(101)}
    reply = exchange(url, head("GET", "/v1/models", {**ADMIN, **many}))
    assert reply.status == 431 and "103 header fields; at most 100" in reply.error()["message"]
    whole = exchange(url, head("GET", "/v1/models", {**ADMIN, "x-big": "b" * 12000}))
    assert whole.status == 200  # 12 KB: under the limit
    large = exchange(url, head("GET", "/v1/models", {**ADMIN, "x-big": "b" * 20000}))
    assert large.status == 431 and "at most 16384 allowed" in large.error()["message"]
    with connect(url) as sock:  # a head that never ends: h11 gives up at the limit
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nx-big: " + b"b" * 40000)
        endless = read_reply(sock)
    assert endless.status == 431 and "over 16384 bytes" in endless.error()["message"]
    garbage = exchange(url, b"\x00\x01 nonsense\r\n\r\n")
    assert garbage.status == 400 and "malformed HTTP request" in garbage.error()["message"]


PROBES = [
    ("GET", "/v1/models"), ("HEAD", "/v1/models"), ("OPTIONS", "/v1/models"),
    ("GET", "/v1/models/"), ("GET", "/v1/models%2F"), ("GET", "/v1/models/tiny"),
    ("HEAD", "/v1/models/tiny"),
    ("GET", "/v1/models/../../metrics"), ("GET", "/metrics"), ("HEAD", "/metrics"),
    ("OPTIONS", "/metrics"), ("POST", "/metrics"), ("GET", "/metrics?x=1"),
    ("POST", CHAT), ("OPTIONS", CHAT), ("HEAD", CHAT), ("GET", TEXT), ("POST", TEXT),
    ("POST", "/admin/reset_prefix_cache"), ("GET", "/admin/reset_prefix_cache"),
    ("GET", "/admin/prefixes"), ("HEAD", "/admin/prefixes?limit=5"),
    ("GET", "/admin/requests/chatcmpl-x"), ("HEAD", "/admin/requests/chatcmpl-x"),
    ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/redoc"),
]  # fmt: skip
UNROUTED = ["//v1/models", "/v1//models", "//metrics", "/metrics/", "/v1/", "/health/"]


@pytest.mark.parametrize("host", ["x", "x/v1?", "127.0.0.1/health?", "x/health#"])
def test_auth_cannot_be_sidestepped(keyed, host):
    url, _ = keyed
    for method, path in PROBES:
        reply = exchange(url, head(method, path, host=host))
        assert reply.status == 401, (method, path, reply.status, reply.body[:200])
        if method != "HEAD":
            assert reply.error()["type"] == "authentication_error"
    for path in UNROUTED:
        reply = exchange(url, head("GET", path, host=host))
        assert reply.status == 404, (path, reply.status)
        assert set(json.loads(reply.body)) == {"error"}
    assert exchange(url, head("GET", "/health", host=host)).status == 200


def test_metrics_need_an_admin_key_and_admin_routes_say_403(keyed):
    url, _ = keyed
    assert loopback.get(url + "/metrics").status_code == 401
    refused = loopback.get(url + "/metrics", headers=BETA)
    assert refused.status_code == 403 and "needs an admin key" in refused.json()["error"]["message"]
    assert loopback.post(url + "/admin/reset_prefix_cache", headers=BETA).status_code == 403
    assert loopback.get(url + "/admin/prefixes", headers=BETA).status_code == 403
    assert loopback.get(url + "/admin/requests/chatcmpl-x", headers=BETA).status_code == 403
    listed = loopback.get(url + "/admin/prefixes?limit=3", headers=ADMIN)
    assert listed.status_code == 200 and set(listed.json()) == {"block_size", "prefixes"}
    for bad in ("0", "101", "x", "-1", "1e2"):
        reply = loopback.get(url + f"/admin/prefixes?limit={bad}", headers=ADMIN)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "limit"
    scraped = loopback.get(url + "/metrics", headers=ADMIN)
    assert scraped.status_code == 200 and "prefixcache_kv_blocks" in scraped.text
    options = httpx.options(url + "/metrics", headers=ADMIN)  # authenticated: now the 405
    assert options.status_code == 405


# The Accept header of a Prometheus 2.x scrape (OpenMetrics first).
PROMETHEUS_ACCEPT = {
    "Accept": "application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
    "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
}


def test_the_metrics_port_serves_loopback_without_a_key(keyed):
    _, state = keyed
    port = free_port()
    server = serve_metrics(state.metrics, port)
    try:
        assert server.server_address[0] == "127.0.0.1"
        scraped = loopback.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
        assert scraped.status_code == 200 and "prefixcache_kv_blocks" in scraped.text
        # what Prometheus asks for: the text format all the same, vLLM's names unescaped
        asked = loopback.get(f"http://127.0.0.1:{port}/metrics", headers=PROMETHEUS_ACCEPT)
        assert asked.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
        assert "\nvllm:num_requests_running{" in asked.text
        assert "vllm_" not in asked.text
    finally:
        server.shutdown()
        server.server_close()


def test_a_tenant_cannot_take_all_of_max_pending(keyed):
    url, state = keyed
    long = {"model": "tiny", "prompt": "hold", "max_tokens": 400, "ignore_eos": True}

    async def scenario() -> tuple[list[int], httpx.Response, httpx.Response, httpx.Response]:
        async with loopback.AsyncClient(base_url=url, timeout=60) as http:
            held = [
                http.stream("POST", TEXT, json={**long, "stream": True}, headers=BETA)
                for _ in range(2)
            ]
            opened = [await stream.__aenter__() for stream in held]
            lines = [response.aiter_lines() for response in opened]  # kept: closing one
            first = [await anext(line) for line in lines]  # would close its stream
            third = await http.post(TEXT, json=long, headers=BETA)
            batch_alpha = await http.post(
                TEXT, json={**long, "prompt": ["a", "b", "c"], "max_tokens": 2}, headers=ADMIN
            )
            other = await http.post(TEXT, json={**long, "max_tokens": 2}, headers=ADMIN)
            for stream in held:
                await stream.__aexit__(None, None, None)  # the client goes away
            return [line.startswith("data: ") for line in first], third, batch_alpha, other

    step = state.engine.step

    def slow_step():  # runs on the engine thread: the held streams last ~8 s unless closed
        time.sleep(0.02)
        return step()

    state.engine.step = slow_step
    try:
        started, third, batch, other = asyncio.run(scenario())
    finally:
        del state.engine.step
    assert started == [True, True]
    assert third.status_code == 429 and third.headers["retry-after"] == "1"
    assert "tenant 'beta' has 2 requests in flight (limit 2" in third.json()["error"]["message"]
    assert batch.status_code == 429 and "limit 2" in batch.json()["error"]["message"]
    assert other.status_code == 200  # the other tenant is still served
    wait_idle(state)
    again = post(url, TEXT, _text(), BETA)  # beta's share came back
    assert again.status_code == 200, again.text


def test_openapi_declares_the_bodies_and_every_status(keyed):
    url, _ = keyed
    schema = loopback.get(url + "/openapi.json", headers=ADMIN).json()
    components = schema["components"]["schemas"]
    for path, model, field in ((CHAT, "ChatCompletionRequest", "messages"),
                               (TEXT, "CompletionRequest", "prompt")):  # fmt: skip
        operation = schema["paths"][path]["post"]
        body = operation["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
        assert field in components[model]["properties"]
        assert {"400", "401", "404", "408", "413", "429", "431", "503"} <= set(
            operation["responses"]
        )
        assert "text/event-stream" in operation["responses"]["200"]["content"]
    assert {"401", "403"} <= set(schema["paths"]["/metrics"]["get"]["responses"])
    assert {"401", "403"} <= set(schema["paths"]["/admin/reset_prefix_cache"]["post"]["responses"])
    lookups = (("/v1/messages/count_tokens", "CountTokensRequest"),
               ("/tokenize", "TokenizeRequest"), ("/detokenize", "DetokenizeRequest"))  # fmt: skip
    for path, model in lookups:
        operation = schema["paths"][path]["post"]
        body = operation["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
        assert {"400", "401", "404", "429"} <= set(operation["responses"])
    stored = schema["paths"]["/v1/responses/{response_id}"]
    assert {"get", "delete"} <= set(stored) and "404" in stored["get"]["responses"]
    listing = schema["paths"]["/v1/responses/{response_id}/input_items"]["get"]
    assert {p["name"] for p in listing["parameters"]} >= {"response_id", "limit", "order", "after"}
    assert "422" not in json.dumps(schema)
    assert components["ChatMessage"]["properties"]["content"]["anyOf"][0] == {"type": "string"}


def test_preparation_runs_below_the_engine_priority():
    import os
    import threading

    import anyio

    from prefixcache.server.prepare_pool import NICENESS, PreparePool

    def own_niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    before = own_niceness()
    assert anyio.run(PreparePool(1).run, own_niceness) == max(before, NICENESS)
    assert own_niceness() == before  # the caller (here: the engine's side) keeps its priority
