"""The fuzzer (``fuzz_fixtures.fuzz``: schemathesis) against the live server on loopback,
every endpoint, a bounded number of examples; the nightly size is benchmarks/fuzz_nightly.py."""

from __future__ import annotations

import time

from engine_fixtures import assert_pool_clean, tiny_engine
from fuzz_fixtures import fuzz
from prefixcache.protocol.auth import Tenants
from prefixcache.protocol.limits import Limits
from server_fixtures import running_server, wait_idle, write_key_file

ADMIN = {"authorization": "Bearer sk-alpha"}
EXAMPLES = 12  # per operation and mode: the file takes about 15 s here (nightly: 1,000)
OPERATIONS = {
    "GET /health", "GET /metrics", "GET /v1/models", "GET /v1/models/{model_id}",
    "POST /v1/chat/completions", "POST /v1/completions", "POST /v1/messages",
    "POST /v1/responses", "POST /admin/reset_prefix_cache", "POST /v1/messages/count_tokens",
    "POST /tokenize", "POST /detokenize", "GET /v1/responses/{response_id}",
    "DELETE /v1/responses/{response_id}", "GET /v1/responses/{response_id}/input_items",
    "GET /admin/prefixes", "GET /admin/requests/{request_id}",
}  # fmt: skip


def test_every_operation_survives_the_fuzzer(tmp_path):
    engine = tiny_engine(num_kv_blocks=256, max_num_seqs=16)
    tenants = Tenants.from_file(write_key_file(tmp_path))
    limits = Limits(request_read_timeout=10.0)
    with running_server(engine, tenants, max_pending=64, limits=limits) as (url, state):
        started = time.monotonic()
        ran = fuzz(url, ADMIN, EXAMPLES)
        print(f"fuzzed {ran} in {time.monotonic() - started:.1f} s")
        wait_idle(state)
        assert state.pool.busy == 0 and state.in_flight.held("alpha") == 0
    assert {label.rsplit(" ", 1)[0] for label in ran} == OPERATIONS
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"):
        assert f"POST {path} negative" in ran
    assert_pool_clean(engine)
    assert engine.manager.stats.queries > 0  # valid cases reached the engine
