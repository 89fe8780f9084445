"""Every disconnect aborts within one engine step; SIGTERM drains, then aborts and exits."""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time

import httpx
import pytest

import loopback
from engine_fixtures import assert_pool_clean, tiny_engine
from prefixcache.protocol.auth import Tenants
from prefixcache.server.app import create_app, graceful_server
from server_fixtures import free_port, running_server, wait_idle

LONG = b'{"model": "tiny", "prompt": "go on", "max_tokens": 400, "ignore_eos": true}'


def _slow_steps(engine, seconds: float) -> list[int]:
    """Make every step take at least ``seconds``; the returned list counts steps."""
    count = [0]
    step = engine.step

    def slow():
        count[0] += 1
        time.sleep(seconds)
        return step()

    engine.step = slow
    return count


def _wait(condition, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _send(port: int, path: str, body: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    sock.sendall(head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


@pytest.mark.parametrize("stream", [False, True])
def test_a_disconnect_aborts_within_one_step_and_is_logged(stream, caplog):
    engine = tiny_engine()
    steps = _slow_steps(engine, 0.02)
    body = LONG.replace(b"}", b', "stream": true}') if stream else LONG
    with (
        caplog.at_level(logging.INFO, "prefixcache.server"),
        running_server(engine, Tenants(None)) as (url, state),
    ):
        port = int(url.rsplit(":", 1)[1])
        sock = _send(port, "/v1/completions", body)
        _wait(lambda: engine.scheduler.running)
        time.sleep(0.2)  # a few tokens in
        sock.close()
        at_close = steps[0]
        _wait(lambda: not engine.requests)
        assert steps[0] - at_close <= 2  # the step running at the close, and at most one more
        wait_idle(state)
    assert_pool_clean(engine)
    lines = [r.getMessage() for r in caplog.records if "status=" in r.getMessage()]
    assert lines and "status=disconnected" in lines[-1]
    tokens = int(lines[-1].split("completion_tokens=")[1].split()[0])
    assert tokens < 100


def test_shutdown_lets_short_requests_finish_then_aborts_the_rest_and_exits():
    engine = tiny_engine()
    _slow_steps(engine, 0.02)  # the long request needs ~8 s, the short one ~0.3 s
    app = create_app(engine, Tenants(None), "tiny")
    port = free_port()
    server = graceful_server(app, "127.0.0.1", port, shutdown_timeout=1.0)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    _wait(lambda: server.started)
    url = f"http://127.0.0.1:{port}/v1/completions"
    results: dict[str, object] = {}

    def call(name: str, max_tokens: int) -> None:
        body = {"model": "tiny", "prompt": name, "max_tokens": max_tokens, "ignore_eos": True}
        try:
            results[name] = loopback.post(url, json=body, timeout=30).status_code
        except httpx.HTTPError as error:
            results[name] = type(error).__name__

    callers = [threading.Thread(target=call, args=a) for a in (("long", 400), ("short", 12))]
    for caller in callers:
        caller.start()
    _wait(lambda: len(engine.scheduler.running) == 2)
    started = time.monotonic()
    server.handle_exit(signal.SIGTERM, None)
    assert app.state.server.draining
    thread.join(timeout=20)
    took = time.monotonic() - started
    for caller in callers:
        caller.join(timeout=20)
    assert not thread.is_alive() and took < 4.0, took
    assert results["short"] == 200  # finished inside the grace period
    assert results["long"] == 503  # aborted when the grace period ran out, and told so
    with pytest.raises(httpx.HTTPError):
        loopback.post(url, json={"model": "tiny", "prompt": "late"}, timeout=2)
    assert_pool_clean(engine)


def test_a_draining_server_refuses_new_requests_with_503():
    engine = tiny_engine()
    with running_server(engine, Tenants(None)) as (url, state):
        state.draining = True
        refused = loopback.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x"})
        state.draining = False
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
