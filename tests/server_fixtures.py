"""A real uvicorn server on loopback, in a thread, for the server tests."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import uvicorn

from ports import free_port
from prefixcache.engine.engine import LLMEngine
from prefixcache.protocol.auth import Tenants
from prefixcache.protocol.front import uvicorn_config
from prefixcache.protocol.limits import Limits
from prefixcache.server.app import Server, create_app

KEYS = {
    "alpha": {"keys": ["sk-alpha"], "admin": True},
    "beta": {"keys": ["sk-beta"]},
    "private": {"keys": ["sk-private"], "no_reuse": True},
}


def write_key_file(folder: Path) -> Path:
    path = folder / "keys.json"
    path.write_text(json.dumps({"tenants": [{"name": n, **v} for n, v in KEYS.items()]}))
    return path


@contextmanager
def running_server(
    engine: LLMEngine,
    tenants: Tenants,
    model_name: str = "tiny",
    max_pending: int = 256,
    limits: Limits | None = None,
) -> Iterator[tuple[str, Server]]:
    """Serve ``engine`` on a free loopback port, as `prefixcache serve` configures uvicorn;
    yield (base URL, server state)."""
    app = create_app(engine, tenants, model_name, max_pending=max_pending, limits=limits)
    port = free_port()
    timeout = app.state.server.limits.request_read_timeout
    config = uvicorn_config(app, "127.0.0.1", port, timeout, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", app.state.server
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def wait_idle(state: Server, timeout: float = 30) -> None:
    """Until no request is being read, prepared or run (aborts of gone clients land
    asynchronously)."""
    deadline = time.monotonic() + timeout
    while (
        state.engine.requests
        or state.async_engine.num_pending
        or state.pool.busy
        or state.in_flight.total
    ):
        if time.monotonic() > deadline:
            raise AssertionError(f"engine still busy: {list(state.engine.requests)}")
        time.sleep(0.05)
