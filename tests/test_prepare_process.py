"""Large bodies are prepared in worker processes (their own GIL, a lower priority); a worker
that dies costs no request: the body it held is prepared on a thread, and the next large body
starts new workers."""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import anyio
import httpx
import pytest

import loopback
from engine_fixtures import assert_pool_clean, default_tokenizer, tiny_engine
from prefixcache.protocol.auth import Tenants
from prefixcache.protocol.errors import ApiError
from prefixcache.server.prepare import PrepareContext, prepare_completion
from prefixcache.server.prepare_pool import NICENESS, PROCESS_BODY_BYTES, PreparePool
from server_fixtures import running_server, wait_idle

JSON = {"content-type": "application/json"}
COMPLETION = {"model": "tiny", "prompt": "The ferry leaves at", "max_tokens": 4,
              "temperature": 0, "ignore_eos": True}  # fmt: skip
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "When does it leave?"}],
        "max_tokens": 4, "temperature": 0, "ignore_eos": True}  # fmt: skip


def padded(body: dict) -> bytes:
    """``body`` as JSON padded with whitespace past the process threshold: same request."""
    raw = json.dumps(body).encode()
    return raw[:-1] + b" " * PROCESS_BODY_BYTES + b"}"


@pytest.fixture(scope="module")
def served():
    engine = tiny_engine(num_kv_blocks=128)
    with running_server(engine, Tenants(None)) as (url, state):
        yield url, state, engine


@pytest.fixture(autouse=True)
def _clean(served):
    yield
    _, state, engine = served
    wait_idle(state)
    assert_pool_clean(engine)


def post(url: str, path: str, content: bytes) -> httpx.Response:
    return loopback.post(url + path, content=content, headers=JSON, timeout=60)


def test_a_large_body_is_answered_from_a_lower_priority_worker_process(served):
    url, state, _ = served
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        small = post(url, path, json.dumps(body).encode()).json()
        large = post(url, path, padded(body))
        assert large.status_code == 200, large.text
        assert large.json()["choices"] == small["choices"]  # the template compiled in a worker
    pids = state.pool.worker_pids()
    assert pids and os.getpid() not in pids
    floor = max(NICENESS, os.getpriority(os.PRIO_PROCESS, 0))
    assert all(os.getpriority(os.PRIO_PROCESS, pid) >= floor for pid in pids)


def test_a_workers_errors_are_the_same_error_objects(served):
    url, _, _ = served
    too_long = {**COMPLETION, "prompt": "word " * PROCESS_BODY_BYTES}
    reply = post(url, "/v1/completions", json.dumps(too_long).encode())
    assert reply.status_code == 400 and "at most" in reply.json()["error"]["message"]
    other = post(url, "/v1/completions", padded({**COMPLETION, "model": "other"}))
    assert other.status_code == 404 and other.json()["error"]["param"] == "model"
    broken = post(url, "/v1/completions", b'{"model": "tiny", "prompt": ' + b" " * 2**17)
    assert broken.status_code == 400 and broken.json()["error"]["type"] == "invalid_request_error"


def test_a_killed_worker_costs_no_request(served):
    url, state, _ = served
    assert post(url, "/v1/completions", padded(COMPLETION)).status_code == 200
    before = state.pool.worker_pids()
    for pid in before:
        os.kill(pid, signal.SIGKILL)
    time.sleep(0.2)  # the pool notices the death
    reply = post(url, "/v1/completions", padded(COMPLETION))
    assert reply.status_code == 200, reply.text  # prepared on a thread
    assert post(url, "/v1/completions", padded(COMPLETION)).status_code == 200
    after = state.pool.worker_pids()
    assert after and not set(after) & set(before)  # new workers took over


def _dies_in_a_worker(raw: bytes, ctx: PrepareContext) -> SimpleNamespace:
    """A preparation whose worker process dies under it; on a thread it returns its pid."""
    if multiprocessing.parent_process() is not None:
        os._exit(1)
    return SimpleNamespace(shape=SimpleNamespace(tokenizer=ctx.tokenizer), pid=os.getpid())


def test_a_worker_dying_mid_preparation_hands_the_body_to_a_thread():
    tokenizer = default_tokenizer()
    ctx = PrepareContext(tokenizer, "tiny", 512, tokenizer.vocab_size, 40_000)
    pool = PreparePool(2)
    try:
        ready = anyio.run(pool.prepare, _dies_in_a_worker, b" " * PROCESS_BODY_BYTES, ctx)
    finally:
        pool.close()
    assert ready.pid == os.getpid() and ready.shape.tokenizer is tokenizer


ABANDONING_SERVER = """
import os, time
from prefixcache.engine.model_files import load_tokenizer
from prefixcache.server.prepare import PrepareContext
from prefixcache.server.prepare_pool import PreparePool
if __name__ == "__main__":
    tokenizer = load_tokenizer()
    pool = PreparePool(2)
    pool.warm(PrepareContext(tokenizer, "m", 512, tokenizer.vocab_size, 1000))
    while len(pool.worker_pids()) < 2:
        time.sleep(0.05)
    print(*pool.worker_pids(), flush=True)
    os._exit(0)  # gone without closing the pool, while its workers still start up
"""


def test_workers_exit_when_their_server_dies_without_closing_them(tmp_path):
    script = tmp_path / "abandon.py"
    script.write_text(ABANDONING_SERVER)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    pids = [int(pid) for pid in done.stdout.split()]
    assert len(pids) == 2, done.stderr
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")


def test_what_crosses_the_process_boundary_pickles_whole():
    error = pickle.loads(pickle.dumps(ApiError(429, "slow down", "n", {"Retry-After": "1"})))
    assert (error.status, error.message, error.param, error.headers) == (
        429, "slow down", "n", {"Retry-After": "1"},
    )  # fmt: skip
    tokenizer = default_tokenizer()
    messages = [{"role": "user", "content": "Paged attention, block tables."}]
    expected = tokenizer.encode_chat(messages)  # compiles the template: not pickled
    copy = pickle.loads(pickle.dumps(tokenizer))
    assert copy.encode_chat(messages) == expected
    assert copy.eos_token_ids == tokenizer.eos_token_ids


def test_warm_with_busy_starts_the_workers_only_once_the_engine_is_quiet():
    tokenizer = default_tokenizer()
    pool = PreparePool(2)
    busy = [True]
    try:
        pool.warm(
            PrepareContext(tokenizer, "m", 512, tokenizer.vocab_size, 1000),
            lambda: busy[0],
            quiet=0.2,
        )
        time.sleep(1.0)  # five quiet periods' worth of polling, all busy
        assert pool.worker_pids() == []
        busy[0] = False
        deadline = time.monotonic() + 60
        while len(pool.worker_pids()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(pool.worker_pids()) == 2
    finally:
        pool.close()


def test_the_first_large_body_starts_every_worker_before_the_pool_watches_them():
    """Under spawn, CPython starts a worker per submit while the manager thread watches the
    worker dict: a worker killed by a group signal made that thread iterate the dict as the
    next submit grew it (a traceback at Ctrl-C). All start at the first submit instead."""
    tokenizer = default_tokenizer()
    pool = PreparePool(2, processes=3)
    try:
        ctx = PrepareContext(tokenizer, "tiny", 512, tokenizer.vocab_size, 1000)
        ready = anyio.run(pool.prepare, prepare_completion, padded(COMPLETION), ctx)
        assert ready.shape.tokenizer is tokenizer and ready.prompts
        assert len(pool.worker_pids()) == 3  # not one per body so far
    finally:
        pool.close()
