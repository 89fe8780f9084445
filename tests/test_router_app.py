"""The router's HTTP front over fake replicas (small FastAPI apps): exact bytes, retries, errors."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

import loopback
from prefixcache.protocol.auth import Tenants
from prefixcache.protocol.errors import ERROR_TYPES
from prefixcache.router.app import RouterConfig, RouterState
from prefixcache.router.forward import REPLICA_HEADER
from prefixcache.router.index import GlobalIndex
from prefixcache.router.policy import make_policy
from prefixcache.router.replicas import ClusterNamespace, Fleet
from router_fixtures import metric_total, running_router, serving
from server_fixtures import free_port, write_key_file

NAMESPACE = "ab" * 32
STREAM = [b'data: {"n": 1}\n\ndata: {"n"', b": 2}\n\n", b"data: [DONE]\n\n"]  # cut mid-event
Routed = tuple[str, list[str], RouterState]  # router URL, replica URLs, router state
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@dataclass
class FakeReplica:
    """What a fake replica answers, and what it was sent."""

    namespace: str = NAMESPACE
    status: int = 200
    seen_authorization: list[str | None] = field(default_factory=list)

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> dict:
            return {
                "status": "ok",
                "model": "tiny",
                "block_size": 4,
                "namespace_digest": self.namespace,
                "tier": None,
                "kv_events": None,
            }

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response("prefixcache_requests_running 0.0\nprefixcache_requests_waiting 0.0\n")

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            self.seen_authorization.append(request.headers.get("authorization"))
            if self.status != 200:
                return JSONResponse({"error": {"message": "busy"}}, status_code=self.status)
            if (await request.json()).get("stream"):
                return StreamingResponse(_slowly(STREAM), media_type="text/event-stream")
            return JSONResponse({"answer": "whole"})

        return app


async def _slowly(chunks: list[bytes]):
    for chunk in chunks:
        yield chunk
        await asyncio.sleep(0.01)


@contextmanager
def router_over(
    *fakes: FakeReplica, **options: object
) -> Iterator[tuple[str, list[str], RouterState]]:
    """A round-robin router (no tokenizer needed) over the fakes; (router URL, replica URLs)."""
    with ExitStack() as stack:
        urls = [stack.enter_context(serving(fake.app())) for fake in fakes]
        config = RouterConfig(urls, make_policy("round-robin"), **options)  # type: ignore[arg-type]
        url, state = stack.enter_context(running_router(config))
        yield url, urls, state


def test_a_stream_passes_through_byte_for_byte() -> None:
    body = {**BODY, "stream": True}
    with (
        router_over(FakeReplica()) as (url, replicas, _),
        loopback.stream("POST", f"{url}/v1/chat/completions", json=body) as r,
    ):
        received = b"".join(r.iter_raw())
        assert r.headers[REPLICA_HEADER] == replicas[0]
    assert received == b"".join(STREAM)


def test_a_429_is_retried_once_on_another_replica() -> None:
    busy, idle = FakeReplica(status=429), FakeReplica()
    with router_over(busy, idle) as (url, replicas, state):
        for _ in range(2):  # turn 0 is the busy one (then the retry), turn 1 the idle one
            response = loopback.post(f"{url}/v1/chat/completions", json=BODY)
            assert response.status_code == 200 and response.headers[REPLICA_HEADER] == replicas[1]
        assert metric_total(state, "prefixcache_router_retries_total") == 1
        assert len(busy.seen_authorization) == 1 and len(idle.seen_authorization) == 2
        busy_only = FakeReplica(status=429)
    with router_over(busy_only) as (url, replicas, _):
        response = loopback.post(f"{url}/v1/chat/completions", json=BODY)
        assert response.status_code == 429 and response.headers[REPLICA_HEADER] == replicas[0]


def test_no_healthy_replica_is_a_503_error_object() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    config = RouterConfig([dead], make_policy("round-robin"))
    with running_router(config) as (url, _):
        response = loopback.post(f"{url}/v1/chat/completions", json=BODY)
        assert response.status_code == 503
        error = response.json()["error"]
        reason = "no replica is ready yet (0 of 1 healthy; replicas are loading the model)"
        assert error["message"] == reason and dead not in error["message"]
        assert error["type"] == ERROR_TYPES.get(503, "server_error")  # as a replica says it
        health = loopback.get(f"{url}/health")
        assert health.status_code == 503 and health.json()["replicas"][0]["healthy"] is False
        assert health.json()["detail"] == reason


def test_the_503_reason_counts_replicas_and_names_no_url() -> None:
    urls = ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    fleet = Fleet(urls, GlobalIndex(), client=None)  # no request is made
    assert fleet.unavailable_reason() == (
        "no replica is ready yet (0 of 2 healthy; replicas are loading the model)"
    )
    fleet.namespace = ClusterNamespace("tiny", 16, bytes(32))
    fleet.replicas[urls[1]].refused = "its namespace differs"
    reason = fleet.unavailable_reason()
    assert reason == (
        "no replica is healthy (0 of 2 healthy, 1 refused for another model or block size; "
        "they stopped answering health checks)"
    )
    assert not any(url in reason for url in urls)


def test_a_replica_with_another_namespace_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="prefixcache.router")
    with router_over(FakeReplica(), FakeReplica(namespace="cd" * 32)) as (url, replicas, state):
        assert [r.healthy for r in state.fleet.replicas.values()] == [True, False]
        served = {
            loopback.post(f"{url}/v1/chat/completions", json=BODY).headers[REPLICA_HEADER]
            for _ in range(3)
        }
        assert served == {replicas[0]}
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 1 and replicas[1] in refusals[0] and "namespace" in refusals[0]


def test_keys_are_checked_and_the_authorization_header_passes_unchanged(tmp_path) -> None:
    fake = FakeReplica()
    tenants = Tenants.from_file(write_key_file(tmp_path))
    with router_over(fake, tenants=tenants) as (url, _, _):
        ok = loopback.post(
            f"{url}/v1/chat/completions", json=BODY, headers={"Authorization": "Bearer sk-beta"}
        )
        bad = loopback.post(
            f"{url}/v1/chat/completions", json=BODY, headers={"Authorization": "Bearer sk-nope"}
        )
    assert ok.status_code == 200 and fake.seen_authorization == ["Bearer sk-beta"]
    assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
