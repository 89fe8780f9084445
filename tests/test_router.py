"""The router over two real replicas (``prefixcache serve`` subprocesses on the tiny model).

Tests share the two replicas (their start-up is most of the cost); each uses documents of
its own so warm caches from another test cannot make it pass. The last test kills one.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest

import loopback
from prefixcache.engine.model_files import load_tokenizer
from prefixcache.engine.tokenizer import Tokenizer
from prefixcache.protocol.auth import Tenants
from prefixcache.protocol.errors import ApiError
from prefixcache.router.app import RouterConfig
from prefixcache.router.digests import prompt_digests
from prefixcache.router.forward import REPLICA_HEADER
from prefixcache.router.index import Overlap
from prefixcache.router.policy import make_policy
from prefixcache.router.prompts import routing_view
from router_fixtures import (
    ReplicaProcess,
    metric_total,
    running_router,
    tiny_replicas,
    wait_until,
)

KEY = "sk-alpha"
AUTH = {"Authorization": f"Bearer {KEY}"}  # tenant alpha, an admin
RESPONSE_ID = re.compile(r'"id":\s*"([^"]+)"')


@dataclass
class Cluster:
    replicas: list[ReplicaProcess]
    tokenizer: Tokenizer
    tenants: Tenants

    def config(self, policy: str = "cache-aware", **options: object) -> RouterConfig:
        """A router over both replicas with the replicas' keys and secret."""
        settings = {"health_interval_s": 0.5, **options}
        return RouterConfig(
            [r.url for r in self.replicas],
            make_policy(policy),
            self.tenants,
            self.tokenizer,
            **settings,  # type: ignore[arg-type]
        )

    def digests(self, body: dict) -> list[bytes]:
        """The block digests of a chat body, as the replicas compute them (tenant alpha)."""
        health = loopback.get(f"{self.replicas[0].url}/health").json()
        tenant = self.tenants.authenticate(AUTH["Authorization"])
        tokens = self.tokenizer.encode_chat(body["messages"])
        root = bytes.fromhex(health["namespace_digest"])
        return prompt_digests(
            root, health["block_size"], tokens, self.tenants.cache_salt(tenant, None)
        )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with tiny_replicas(tmp_path_factory.mktemp("router")) as (replicas, tenants, model):
        yield Cluster(replicas, load_tokenizer(model), tenants)


def document(name: str, words: int = 30) -> str:
    return f"Document {name}. " + " ".join(f"{name}{i}" for i in range(words))


def chat(doc: str, question: str, max_tokens: int = 4, **extra: object) -> dict:
    return {
        "model": "tiny",
        "messages": [
            {"role": "system", "content": document(doc)},
            {"role": "user", "content": question},
        ],
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }


def cached_tokens(response: httpx.Response) -> int:
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def sse_events(text: str) -> list[str]:
    return [line.removeprefix("data: ") for line in text.split("\n\n") if line]


def test_a_shared_document_lands_on_one_replica_and_hits_its_cache(cluster: Cluster) -> None:
    with (
        running_router(cluster.config()) as (url, state),
        loopback.Client(base_url=url, headers=AUTH, timeout=30) as client,
    ):
        placed: dict[str, list[tuple[str, int]]] = {"ant": [], "bee": []}
        for question in ("Who?", "What is it?", "Where is it kept?"):
            for doc, seen in placed.items():
                response = client.post("/v1/chat/completions", json=chat(doc, question))
                assert response.status_code == 200, response.text
                seen.append((response.headers[REPLICA_HEADER], cached_tokens(response)))
        for doc, seen in placed.items():
            assert len({replica for replica, _ in seen}) == 1, f"{doc} moved: {seen}"
            assert all(cached > 0 for _, cached in seen[1:]), f"{doc} missed: {seen}"
        replica = placed["ant"][0][0]
        digests = cluster.digests(chat("ant", "Who?"))
        assert state.index.overlap(replica, digests).pool_blocks == len(digests)  # from events
        # Streaming passes through: the same greedy text, [DONE] last, the replica named.
        body = chat("ant", "Who?", max_tokens=6)
        whole = client.post("/v1/chat/completions", json=body).json()
        streamed = client.post("/v1/chat/completions", json={**body, "stream": True})
        assert streamed.headers[REPLICA_HEADER] == replica
        assert streamed.headers["content-type"].startswith("text/event-stream")
        events = sse_events(streamed.text)
        assert events[-1] == "[DONE]"
        text = "".join(
            json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1]
        )
        assert text == whole["choices"][0]["message"]["content"]


def test_the_router_tokenizes_as_the_replica_does(cluster: Cluster) -> None:
    tok = cluster.tokenizer
    body = chat("emu", "Which?", cache_salt="mine", stream=True)
    view = routing_view(json.dumps(body).encode(), "chat", tok)
    assert view == (True, "mine", tok.encode_chat(body["messages"]), None, None)  # no key
    parts = {**body, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]}
    assert routing_view(json.dumps(parts).encode(), "chat", tok).token_ids == tok.encode_chat(
        [{"role": "user", "content": "a"}]
    )
    text = routing_view(b'{"prompt": "Once upon"}', "completions", tok).token_ids
    assert text == tok.encode("Once upon", add_special_tokens=True)
    assert routing_view(b'{"prompt": ["Once upon", "x"]}', "completions", tok).token_ids == text
    assert routing_view(b'{"prompt": [5, 6, 7]}', "completions", tok).token_ids == [5, 6, 7]
    assert routing_view(b'{"prompt": 5}', "completions", tok).token_ids is None  # replica says why
    with pytest.raises(ApiError, match="must be a JSON object"):  # the replica's 400
        routing_view(b"[1]", "chat", tok)
    with pytest.raises(ApiError, match="not valid JSON"):
        routing_view(b"{", "chat", tok)


def test_errors_models_health_and_metrics(cluster: Cluster) -> None:
    with (
        running_router(cluster.config()) as (url, _),
        loopback.Client(base_url=url, headers=AUTH, timeout=30) as client,
    ):
        bad = client.post("/v1/chat/completions", content=b"{not json")
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
        other = client.post("/v1/completions", json={"model": "gpt-x", "prompt": "hi"})
        assert other.status_code == 404 and other.json()["error"]["param"] == "model"
        field = client.post("/v1/chat/completions", json={**chat("cat", "?"), "temperature": 9})
        assert field.status_code == 400 and field.json()["error"]["param"] == "temperature"
        anonymous = loopback.post(f"{url}/v1/chat/completions", json=chat("cat", "?"))
        assert anonymous.status_code == 401 and "API key" in anonymous.json()["error"]["message"]
        models = client.get("/v1/models")
        assert models.json()["data"][0]["id"] == "tiny" and REPLICA_HEADER in models.headers
        text = client.post(
            "/v1/completions", json={"model": "tiny", "prompt": "Once", "max_tokens": 2}
        )
        assert text.status_code == 200 and text.headers[REPLICA_HEADER] in {
            r.url for r in cluster.replicas
        }
        health = client.get("/health").json()
        assert health["status"] == "ok" and health["model"] == "tiny"
        assert [r["healthy"] for r in health["replicas"]] == [True, True]
        assert "url" not in json.dumps(health) and "127.0.0.1" not in json.dumps(health)
        detail = client.get("/admin/replicas").json()["replicas"]  # the admin's view
        assert [r["url"] for r in detail] == [r.url for r in cluster.replicas]
        # the replicas' /metrics need an admin key: the router shows the key file's
        assert [r["load_error"] for r in detail] == [None, None]
        metrics = client.get("/metrics").text
        assert "prefixcache_router_requests_total" in metrics
        assert "prefixcache_router_replica_healthy" in metrics


def test_round_robin_splits_a_shared_document(cluster: Cluster) -> None:
    with (
        running_router(cluster.config("round-robin")) as (url, _),
        loopback.Client(base_url=url, headers=AUTH, timeout=30) as client,
    ):
        replicas = [
            client.post("/v1/chat/completions", json=chat("cow", f"Q{i}?")).headers[REPLICA_HEADER]
            for i in range(4)
        ]
    assert replicas[0] != replicas[1] and replicas[:2] == replicas[2:]


def test_prefix_hash_keeps_a_document_on_one_replica(cluster: Cluster) -> None:
    with (
        running_router(cluster.config("prefix-hash")) as (url, _),
        loopback.Client(base_url=url, headers=AUTH, timeout=30) as client,
    ):
        for doc in ("yak", "zebu"):
            replicas = {
                client.post("/v1/chat/completions", json=chat(doc, f"Q{i}?")).headers[
                    REPLICA_HEADER
                ]
                for i in range(3)
            }
            assert len(replicas) == 1, f"{doc} spread over {replicas}"


def test_a_client_gone_mid_stream_aborts_the_request_on_the_replica(cluster: Cluster) -> None:
    body = chat("owl", "Go on.", max_tokens=300, ignore_eos=True, stream=True)
    with running_router(cluster.config()) as (url, state):
        with loopback.stream("POST", f"{url}/v1/chat/completions", json=body, headers=AUTH) as r:
            replica = next(p for p in cluster.replicas if p.url == r.headers[REPLICA_HEADER])
            next(r.iter_raw())  # the stream started; now the client goes away
        wait_until(lambda: "status=disconnected" in replica.log_tail(200), what="the abort")
        wait_until(lambda: state.fleet.replicas[replica.url].in_flight == 0, what="release")


def test_events_missed_while_the_router_was_down_are_replayed(cluster: Cluster) -> None:
    target = cluster.replicas[1]  # not where a tie would send it (ties start at replica 0)
    body = chat("dog", "Why?")
    direct = loopback.post(f"{target.url}/v1/chat/completions", json=body, headers=AUTH, timeout=30)
    assert direct.status_code == 200  # no router is running: only replay can tell it this
    with running_router(cluster.config()) as (url, state):
        feed = state.fleet.replicas[target.url].feed
        assert feed is not None and feed.synced.wait(10)
        digests = cluster.digests(body)
        assert state.index.overlap(target.url, digests) == Overlap(len(digests), 0)
        # the other replica shares only the chat template's first block ("<|im_start|>system...")
        assert state.index.overlap(cluster.replicas[0].url, digests).pool_blocks <= 1
        follow_up = chat("dog", "And how?")
        routed = loopback.post(
            f"{url}/v1/chat/completions", json=follow_up, headers=AUTH, timeout=30
        )
        assert routed.headers[REPLICA_HEADER] == target.url
        shared = set(digests) & set(cluster.digests(follow_up))
        assert cached_tokens(routed) == 4 * len(shared) > 0  # the document's blocks, reused


DRAIN_S = 1.0  # for a frozen replica's sent bytes to reach the client through the router


class Load:
    """Concurrent requests through the router, each result kept with its replica."""

    def __init__(self, url: str) -> None:
        self.client = loopback.Client(base_url=url, headers=AUTH, timeout=60)
        self.pool = ThreadPoolExecutor(16)
        self.started: dict[int, tuple[str, str]] = {}  # stream -> (replica, response id)
        self.running: set[int] = set()  # streams the client is still reading
        self.lock = threading.Lock()

    def whole(self, body: dict):
        return self.pool.submit(self.client.post, "/v1/chat/completions", json=body)

    def stream(self, body: dict, number: int):
        return self.pool.submit(self._stream, {**body, "stream": True}, number)

    def _stream(self, body: dict, number: int) -> tuple[int, str, list[str]]:
        with self.client.stream("POST", "/v1/chat/completions", json=body) as response:
            chunks = []
            for chunk in response.iter_text():
                chunks.append(chunk)
                if number not in self.started and (found := RESPONSE_ID.search(chunk)):
                    with self.lock:
                        self.started[number] = (response.headers[REPLICA_HEADER], found[1])
                        self.running.add(number)
            with self.lock:
                self.running.discard(number)
            return (
                response.status_code,
                response.headers[REPLICA_HEADER],
                sse_events("".join(chunks)),
            )

    def unfinished_from(self, replica: str) -> bool:
        """Whether a stream relayed from `replica` has begun and not ended at the client."""
        with self.lock:
            return any(self.started[n][0] == replica for n in self.running)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.client.close()


def test_sigkill_under_load_then_restart(cluster: Cluster) -> None:
    survivor, victim = cluster.replicas
    warm = chat("elk", "Before?")
    assert loopback.post(f"{victim.url}/v1/chat/completions", json=warm, headers=AUTH).is_success
    old = cluster.digests(warm)
    with (
        running_router(cluster.config()) as (url, state),
        running_router(
            cluster.config(health_interval_s=600)  # a watcher that only learns through events
        ) as (_, watcher),
    ):
        for index in (state.index, watcher.index):
            wait_until(
                lambda i=index: i.overlap(victim.url, old).pool_blocks == len(old), what="warm"
            )
        load = Load(url)
        try:
            long = {"max_tokens": 300, "ignore_eos": True}
            # The victim holds "elk": cache-aware sends the answers awaited whole there (the
            # kill must catch some, to be retried) and one stream; fresh documents go by load.
            wholes = [load.whole(chat("elk", f"Go on, {i}.", **long)) for i in range(4)]
            docs = ["elk", "gnu1", "gnu2", "gnu3"]
            streams = [load.stream(chat(d, f"Go on, {i}.", **long), i) for i, d in enumerate(docs)]
            wait_until(lambda: state.fleet.replicas[victim.url].in_flight >= 3, what="victim load")
            # The kill must cut a stream mid-way. The tiny model writes 300 tokens in well under
            # a second, and a loaded machine's client reads them late, so the victim is frozen
            # as soon as one of its streams has begun; once what it had sent has drained to the
            # client, a stream still unfinished there is unfinished on the victim too.
            wait_until(lambda: load.unfinished_from(victim.url), what="a stream from the victim")
            victim.pause()
            time.sleep(DRAIN_S)
            assert load.unfinished_from(victim.url), "the victim's streams ended before the pause"
            victim.kill()
            after = [load.whole(chat(f"hen{i}", "Now?")) for i in range(4)]
            results = [f.result() for f in wholes + after]
            streamed = [f.result() for f in streams]
        finally:
            load.close()
        # Every request that had not started streaming on the victim succeeded (retried).
        assert [r.status_code for r in results] == [200] * 8
        assert {r.headers[REPLICA_HEADER] for r in results[4:]} == {survivor.url}
        assert metric_total(state, "prefixcache_router_retries_total") >= 1  # sent again
        for status, replica, events in streamed:
            assert status == 200 and events[-1] == "[DONE]"
            if replica == victim.url and "error" in events[-2]:
                assert "failed mid-stream" in json.loads(events[-2])["error"]["message"]
        assert any(replica == victim.url and "error" in e[-2] for _, replica, e in streamed)
        # The victim left the rotation and took its index entries with it.
        wait_until(lambda: not state.fleet.replicas[victim.url].healthy, what="victim out")
        assert state.index.counts(victim.url) == (0, 0, 0)

        # Restarted on the same ports: a new epoch. The router rejoins it with a fresh feed;
        # the watcher, which never saw it go, drops its stale entries on the new epoch.
        epoch = victim.start().wait_ready()["kv_events"]["topic"]
        wait_until(lambda: state.fleet.replicas[victim.url].healthy, what="victim back")
        assert state.fleet.replicas[victim.url].feed.topic == epoch.encode()
        assert all(victim.url not in state.index.holders(d) for d in old)
        fresh = chat("ibis", "After?")
        assert loopback.post(
            f"{victim.url}/v1/chat/completions", json=fresh, headers=AUTH
        ).is_success
        new = cluster.digests(fresh)
        # The whole new chain: its first block is the template's, shared with the stale "elk"
        # entries, so "any overlap" would hold before the watcher saw the new epoch at all.
        wait_until(
            lambda: watcher.index.overlap(victim.url, new).pool_blocks == len(new), what="new epoch"
        )
        stale = [d for d in old if d not in new]  # "elk" blocks; the template's first is shared
        assert stale and all(victim.url not in watcher.index.holders(d) for d in stale)
        again = loopback.post(
            f"{url}/v1/chat/completions", json=chat("ibis", "Again?"), headers=AUTH, timeout=30
        )
        assert again.headers[REPLICA_HEADER] == victim.url and cached_tokens(again) > 0
