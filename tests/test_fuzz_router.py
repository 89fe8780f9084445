"""The fuzzer (``fuzz_fixtures.fuzz``: schemathesis) against the router on loopback, over a
live replica: every operation of the router's /openapi.json, a bounded number of examples."""

from __future__ import annotations

import time

from engine_fixtures import assert_pool_clean, tiny_engine
from fuzz_fixtures import fuzz
from prefixcache.engine.model_files import load_tokenizer
from prefixcache.protocol.auth import Tenants
from prefixcache.protocol.limits import Limits
from prefixcache.router.app import RouterConfig
from prefixcache.router.policy import make_policy
from router_fixtures import running_router
from server_fixtures import running_server, wait_idle, write_key_file

ADMIN = {"authorization": "Bearer sk-alpha"}
EXAMPLES = 12  # per operation and mode, as for the replica: the file takes about 15 s here
OPERATIONS = {
    "GET /admin/replicas", "GET /health", "GET /metrics", "GET /v1/models",
    "GET /v1/models/{model_id}",
    "POST /v1/chat/completions", "POST /v1/completions", "POST /v1/messages",
    "POST /v1/responses", "POST /v1/messages/count_tokens", "POST /tokenize", "POST /detokenize",
    "GET /v1/responses/{response_id}", "DELETE /v1/responses/{response_id}",
    "GET /v1/responses/{response_id}/input_items",
}  # fmt: skip


def router_idle(router, timeout: float = 10.0) -> None:
    """No request left admitted or parsing: the last response's release runs on the router's
    loop after its client has read the response, so it may land just after ``fuzz`` returns.
    A leaked ticket never does."""
    deadline = time.monotonic() + timeout
    while router.in_flight.total or router.views.borrowed_tokens:
        if time.monotonic() > deadline:
            raise AssertionError(
                f"router still holds {router.in_flight.total} admitted and "
                f"{router.views.borrowed_tokens} parsing requests after {timeout:.0f} s"
            )
        time.sleep(0.05)


def test_every_router_operation_survives_the_fuzzer(tmp_path):
    engine = tiny_engine(num_kv_blocks=256, max_num_seqs=16)
    tenants = Tenants.from_file(write_key_file(tmp_path))
    limits = Limits(request_read_timeout=10.0)
    with running_server(engine, tenants, max_pending=64, limits=limits) as (replica, state):
        config = RouterConfig(
            [replica], make_policy("cache-aware"), tenants, load_tokenizer(), limits=limits
        )
        with running_router(config) as (url, router):
            started = time.monotonic()
            ran = fuzz(url, ADMIN, EXAMPLES)
            seconds = time.monotonic() - started
            print(f"fuzzed {ran} in {seconds:.1f} s")
            router_idle(router)
        wait_idle(state)
    assert {label.rsplit(" ", 1)[0] for label in ran} == OPERATIONS
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"):
        assert f"POST {path} negative" in ran
    assert seconds < 180  # bounded: 13 operations, about 100 s on a busy 2-core machine
    assert_pool_clean(engine)
    assert engine.manager.stats.queries > 0  # valid cases reached the replica's engine
