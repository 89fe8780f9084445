"""A replica whose KV events are down is routed as if it held nothing (issue 21).

Two real replicas (the tiny model, served on 127.0.0.1 with a publisher each) behind a real
router. One replica's publisher loop is made to fail always: its ``/health`` stays 200 but
says events are down, the router drops what it knew of that replica and claims no cache hit
there; once the loop works again the router resubscribes with replay and trusts it again.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass

import httpx
import pytest

import loopback
from engine_fixtures import tiny_engine
from prefixcache.protocol.auth import Tenants
from prefixcache.router.app import RouterConfig, RouterState
from prefixcache.router.digests import prompt_digests
from prefixcache.router.forward import REPLICA_HEADER
from prefixcache.router.index import BlockCounts, Overlap
from prefixcache.router.policy import make_policy
from prefixcache.server.app import create_app
from prefixcache.server.events import KVEventPublisher, sink_for
from router_fixtures import running_router, serving, wait_until

LOCAL = "tcp://127.0.0.1:*"
SECRET = bytes(range(32))
MESSAGES = [
    {"role": "system", "content": "Document owl. " + " ".join(f"owl{i}" for i in range(30))},
    {"role": "user", "content": "What is it?"},
]
BODY = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, "temperature": 0}


@dataclass
class Cluster:
    publishers: dict[str, KVEventPublisher]  # replica URL -> its publisher
    router_url: str
    state: RouterState
    digests: list[bytes]  # MESSAGES' block digests, as both replicas compute them

    def post(self) -> httpx.Response:
        response = loopback.post(f"{self.router_url}/v1/chat/completions", json=BODY, timeout=30)
        assert response.status_code == 200, response.text
        return response

    def overlap(self, url: str) -> Overlap:
        return self.state.index.overlap(url, self.digests)

    def routed_pool_blocks(self) -> float:
        return self.state.metrics.routed_blocks.labels("pool")._value.get()


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    tenants = Tenants(None, SECRET)
    with ExitStack() as stack:
        publishers: dict[str, KVEventPublisher] = {}
        for _ in range(2):
            engine = tiny_engine(num_kv_blocks=512)
            publisher = KVEventPublisher(LOCAL, LOCAL, flush_interval_s=0.002)
            engine.set_event_sink(sink_for(publisher, include_token_ids=False))
            app = create_app(engine, tenants, "tiny", publisher=publisher)
            publishers[stack.enter_context(serving(app))] = publisher
        tokenizer = engine.tokenizer
        config = RouterConfig(
            list(publishers), make_policy("cache-aware"), tenants, tokenizer,
            health_interval_s=0.2,
        )  # fmt: skip
        url, state = stack.enter_context(running_router(config))
        salt = tenants.cache_salt(tenants.authenticate(None), None)
        root, block_size = engine.manager.root_digest, engine.manager.block_size
        digests = prompt_digests(root, block_size, tokenizer.encode_chat(MESSAGES), salt)
        wait_until(lambda: len(state.fleet.healthy()) == 2, what="both replicas to join")
        yield Cluster(publishers, url, state, digests)


def events_of(url: str) -> tuple[int, dict]:
    response = loopback.get(f"{url}/health", timeout=5)
    return response.status_code, response.json()["kv_events"]


def test_a_replica_with_events_down_is_routed_as_if_it_held_nothing(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    holder = cluster.post().headers[REPLICA_HEADER]
    wait_until(lambda: cluster.overlap(holder).pool_blocks > 0, what="its events to arrive")
    assert cluster.post().headers[REPLICA_HEADER] == holder  # routed to its cache
    assert events_of(holder) == (200, {**events_of(holder)[1], "status": "ok", "failures": 0})

    publisher = cluster.publishers[holder]
    monkeypatch.setattr(publisher, "_wait", lambda timeout_ms: 1 / 0)  # every round fails
    wait_until(lambda: events_of(holder)[1]["status"] == "down", what="events to be down")
    status, events = events_of(holder)
    assert status == 200 and events["failures"] >= 5  # it still serves
    replica = cluster.state.fleet.replicas[holder]
    wait_until(lambda: replica.feed is None, what="the router to drop its feed")
    assert replica.healthy and cluster.state.index.counts(holder) == BlockCounts(0, 0, 0)
    assert cluster.overlap(holder) == Overlap(0, 0)

    before = cluster.routed_pool_blocks()
    for _ in range(2):
        cluster.post()
        assert cluster.overlap(holder) == Overlap(0, 0)  # not even an expectation
    if cluster.routed_pool_blocks() > before:  # a claim can only be the other replica's
        other = next(url for url in cluster.publishers if url != holder)
        assert cluster.overlap(other).pool_blocks > 0

    monkeypatch.undo()  # the loop works again: ok, and the router resubscribes with replay
    wait_until(lambda: events_of(holder)[1]["status"] == "ok", what="events to be ok again")
    wait_until(lambda: replica.feed is not None and replica.feed.synced.is_set(), what="feed")
    wait_until(lambda: cluster.overlap(holder).pool_blocks > 0, what="its blocks replayed")
