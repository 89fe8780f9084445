"""The router in front of the Messages and Responses APIs, over two real replicas (the tiny
model): the anthropic and openai SDKs unchanged, prefix routing for messages and for chat
with tools, ``previous_response_id`` sent to the replica that stored it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

import loopback
from prefixcache.engine.model_files import load_tokenizer
from prefixcache.protocol.auth import Tenants
from prefixcache.protocol.limits import Limits
from prefixcache.protocol.response_ids import instance_of
from prefixcache.router.app import RouterConfig
from prefixcache.router.digests import prompt_digests
from prefixcache.router.forward import REPLICA_HEADER
from prefixcache.router.policy import make_policy
from prefixcache.router.prompts import routing_view
from router_fixtures import (
    ReplicaProcess,
    metric_total,
    running_router,
    tiny_replicas,
    wait_until,
)
from server_fixtures import free_port

KEY = "sk-alpha"
AUTH = {"Authorization": f"Bearer {KEY}"}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a word up",
            "parameters": {"type": "object", "properties": {"word": {"type": "string"}}},
        },
    }
]


class Cluster:
    def __init__(self, replicas: list[ReplicaProcess], tenants: Tenants, model: Path) -> None:
        self.replicas, self.tenants, self.tokenizer = replicas, tenants, load_tokenizer(model)

    def config(self, **options: object) -> RouterConfig:
        return RouterConfig(
            [r.url for r in self.replicas],
            make_policy("cache-aware"),
            self.tenants,
            self.tokenizer,
            health_interval_s=0.5,
            **options,  # type: ignore[arg-type]
        )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with tiny_replicas(tmp_path_factory.mktemp("router-apis")) as (replicas, tenants, model):
        yield Cluster(replicas, tenants, model)


def document(name: str, words: int = 30) -> str:
    return f"Document {name}. " + " ".join(f"{name}{i}" for i in range(words))


def instances(cluster: Cluster) -> dict[str, str]:
    """Each replica's instance id (from its /health) -> its URL."""
    return {loopback.get(f"{r.url}/health").json()["instance"]: r.url for r in cluster.replicas}


def test_the_anthropic_sdk_through_the_router(cluster: Cluster) -> None:
    with running_router(cluster.config()) as (url, _):
        client = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)
        question = [{"role": "user", "content": "Hello there"}]
        message = client.messages.create(model="tiny", max_tokens=4, messages=question)
        assert message.type == "message" and message.usage.output_tokens >= 1
        with client.messages.stream(model="tiny", max_tokens=4, messages=question) as stream:
            final = stream.get_final_message()
        assert final.stop_reason in ("max_tokens", "end_turn")
        stranger = anthropic.Anthropic(base_url=url, api_key="sk-nobody", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as refused:
            stranger.messages.create(model="tiny", max_tokens=4, messages=question)
        assert refused.value.body["error"]["type"] == "authentication_error"


def test_the_routers_own_errors_on_messages_are_anthropics(cluster: Cluster) -> None:
    nobody = f"http://127.0.0.1:{free_port()}"
    config = RouterConfig(
        [nobody], make_policy("cache-aware"), cluster.tenants, cluster.tokenizer,
        limits=Limits(max_body_bytes=2048),
    )  # fmt: skip
    with running_router(config) as (url, _), loopback.Client(base_url=url, headers=AUTH) as client:
        body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        down = client.post("/v1/messages", json=body)
        assert down.status_code == 503
        assert down.json()["type"] == "error"
        assert down.json()["error"]["type"] == "overloaded_error"
        big = client.post("/v1/messages", json={**body, "system": "x" * 4096})
        assert big.status_code == 413 and big.json()["error"]["type"] == "invalid_request_error"
        assert big.json()["type"] == "error"
        chat = client.post("/v1/chat/completions", json=body)
        assert chat.status_code == 503 and "type" not in chat.json()  # OpenAI's shape there
        count = client.post("/v1/messages/count_tokens", json=body)
        assert count.status_code == 503 and count.json()["error"]["type"] == "overloaded_error"
        big_count = client.post("/v1/messages/count_tokens", json={**body, "system": "x" * 4096})
        assert big_count.status_code == 413 and big_count.json()["type"] == "error"
        for method, path in (("POST", "/tokenize"), ("POST", "/detokenize"),
                             ("GET", "/v1/responses/resp_x"), ("DELETE", "/v1/responses/resp_x"),
                             ("GET", "/v1/responses/resp_x/input_items")):  # fmt: skip
            down = client.request(method, path, json={"prompt": "hi"})
            assert down.status_code == 503 and set(down.json()) == {"error"}, (method, path)
        assert loopback.post(f"{url}/tokenize", json={"prompt": "hi"}).status_code == 401


def test_a_repeated_message_goes_to_the_replica_holding_its_prefix(cluster: Cluster) -> None:
    with running_router(cluster.config()) as (url, state):
        client = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)
        placed: dict[str, list[tuple[str, int]]] = {"gnu": [], "yak": []}
        for question in ("Who?", "What is it?", "Where?"):
            for doc, seen in placed.items():
                raw = client.messages.with_raw_response.create(
                    model="tiny", max_tokens=2, system=document(doc),
                    messages=[{"role": "user", "content": question}],
                )  # fmt: skip
                seen.append(
                    (raw.headers[REPLICA_HEADER], raw.parse().usage.cache_read_input_tokens)
                )
        for doc, seen in placed.items():
            assert len({replica for replica, _ in seen}) == 1, f"{doc} moved: {seen}"
            assert all(cached > 0 for _, cached in seen[1:]), f"{doc} missed: {seen}"
        # The router's view of the body is the replica's prompt: its KV events confirm
        # every block of it on the replica it chose (the index is fed by events only).
        body = {"model": "tiny", "max_tokens": 2, "system": document("gnu"),
                "messages": [{"role": "user", "content": "Who?"}]}  # fmt: skip
        view = routing_view(
            httpx.Request("POST", "/", json=body).content, "messages", cluster.tokenizer
        )
        namespace = state.namespace()
        tenant = cluster.tenants.authenticate(AUTH["Authorization"])
        salt = cluster.tenants.cache_salt(tenant, None)
        digests = prompt_digests(namespace.root, namespace.block_size, view.token_ids, salt)
        wait_until(
            lambda: state.index.overlap(placed["gnu"][0][0], digests).pool_blocks == len(digests),
            what="the replica's events for the message's blocks",
        )


def test_the_messages_view_is_the_chat_templates_tokens(cluster: Cluster) -> None:
    tok = cluster.tokenizer
    body = {
        "model": "tiny", "max_tokens": 4, "system": [{"type": "text", "text": "Be brief."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
    }  # fmt: skip
    view = routing_view(httpx.Request("POST", "/", json=body).content, "messages", tok)
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert view.token_ids == tok.encode_chat(turns)
    assert routing_view(b'{"messages": 5}', "messages", tok).token_ids is None  # replica's 400
    responses = {"model": "tiny", "input": "Hi", "instructions": "Be brief."}
    raw = httpx.Request("POST", "/", json=responses).content
    assert routing_view(raw, "responses", tok).token_ids == tok.encode_chat(turns)


def test_a_repeated_chat_with_tools_goes_to_the_replica_holding_it(cluster: Cluster) -> None:
    with (
        running_router(cluster.config()) as (url, _),
        loopback.Client(base_url=url, headers=AUTH, timeout=60) as client,
    ):
        for doc in ("owl", "elk"):
            messages = [
                {"role": "system", "content": document(doc)},
                {"role": "user", "content": "Look it up"},
            ]
            body = {"model": "tiny", "messages": messages, "tools": TOOLS, "max_tokens": 2}
            seen = []
            for _ in range(3):
                response = client.post("/v1/chat/completions", json=body)
                assert response.status_code == 200, response.text
                cached = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                seen.append((response.headers[REPLICA_HEADER], cached))
            assert len({replica for replica, _ in seen}) == 1, f"{doc} moved: {seen}"
            assert all(cached > 0 for _, cached in seen[1:]), f"{doc} missed: {seen}"


def test_previous_response_id_goes_to_the_replica_that_stored_it(cluster: Cluster) -> None:
    by_instance = instances(cluster)
    assert len(by_instance) == 2  # each replica drew its own
    with running_router(cluster.config()) as (url, state):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        raw = client.responses.with_raw_response.create(
            model="tiny", input=document("rho", 10), max_output_tokens=2
        )
        first_ids = [raw.parse().id]
        assert by_instance[instance_of(first_ids[0])] == raw.headers[REPLICA_HEADER]
        for replica in cluster.replicas:  # one stored on each replica, whatever the policy likes
            direct = openai.OpenAI(base_url=f"{replica.url}/v1", api_key=KEY, max_retries=0)
            made = direct.responses.create(
                model="tiny", input=document("tau", 10), max_output_tokens=2
            )
            assert by_instance[instance_of(made.id)] == replica.url
            first_ids.append(made.id)
        for response_id in first_ids:
            raw = client.responses.with_raw_response.create(
                model="tiny", input="And then?", previous_response_id=response_id,
                max_output_tokens=2,
            )  # fmt: skip
            follow = raw.parse()
            assert raw.headers[REPLICA_HEADER] == by_instance[instance_of(response_id)]
            assert follow.previous_response_id == response_id
            assert follow.usage.input_tokens > 10  # the stored conversation came along
        pinned = [
            s.value for f in state.metrics.registry.collect() for s in f.samples
            if s.name == "prefixcache_router_decisions_total"
            and s.labels.get("reason") == "previous_response"
        ]  # fmt: skip
        assert sum(pinned) == 3
        unknown = "resp_0000000000000000000000000000"  # no replica has that instance
        with pytest.raises(openai.NotFoundError) as missing:
            client.responses.create(model="tiny", input="x", previous_response_id=unknown)
        assert missing.value.body["param"] == "previous_response_id"


def test_prompt_cache_key_on_responses_keeps_a_tenant_on_one_replica(cluster: Cluster) -> None:
    with (
        running_router(cluster.config()) as (url, state),
        loopback.Client(base_url=url, headers=AUTH, timeout=60) as client,
    ):
        seen = set()
        for i in range(4):
            body = {"model": "tiny", "input": f"question {i}", "max_output_tokens": 2,
                    "prompt_cache_key": "tenant-a-thread"}  # fmt: skip
            response = client.post("/v1/responses", json=body)
            assert response.status_code == 200, response.text
            seen.add(response.headers[REPLICA_HEADER])
        assert len(seen) == 1
        assert metric_total(state, "prefixcache_router_key_affinity_total") == 4


def test_token_counts_and_ids_through_the_router(cluster: Cluster) -> None:
    with (
        running_router(cluster.config()) as (url, _),
        loopback.Client(base_url=url, headers=AUTH, timeout=60) as http,
    ):
        claude = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)
        tool = {"name": "lookup", "input_schema": {"type": "object"}}
        fields = {"system": [{"type": "text", "text": document("kea", 8)}],
                  "messages": [{"role": "user", "content": "Who?"}], "tools": [tool]}  # fmt: skip
        counted = claude.messages.count_tokens(model="tiny", **fields).input_tokens
        used = claude.messages.create(model="tiny", max_tokens=1, **fields).usage
        cached = used.cache_read_input_tokens + used.cache_creation_input_tokens
        assert counted == used.input_tokens + cached > 0
        with pytest.raises(anthropic.BadRequestError) as bad:
            claude.messages.count_tokens(model="tiny", messages=[])
        assert bad.value.body["type"] == "error"  # the replica's 400, in Anthropic's shape
        messages = [{"role": "user", "content": document("ibis", 8)}]
        ids = http.post("/tokenize", json={"messages": messages, "tools": TOOLS}).json()
        chat = http.post("/v1/chat/completions", json={
            "model": "tiny", "messages": messages, "tools": TOOLS, "max_tokens": 1,
            "tool_choice": "none"})  # fmt: skip
        assert ids["count"] == chat.json()["usage"]["prompt_tokens"]
        body = {"model": "tiny", "messages": messages, "tools": TOOLS}
        raw = httpx.Request("POST", "/", json=body).content
        assert routing_view(raw, "chat", cluster.tokenizer).token_ids == ids["tokens"]
        text = http.post("/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"]
        again = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
        assert again.json()["tokens"] == ids["tokens"]
        bad_ids = http.post("/detokenize", json={"tokens": [0, -1]})
        assert bad_ids.status_code == 400 and bad_ids.json()["error"]["param"] == "tokens.1"


def test_stored_responses_are_read_and_deleted_on_the_replica_that_stored_them(
    cluster: Cluster,
) -> None:
    by_instance = instances(cluster)
    made = []
    for replica in cluster.replicas:  # one stored on each replica, whatever the policy likes
        direct = openai.OpenAI(base_url=f"{replica.url}/v1", api_key=KEY, max_retries=0)
        made.append(direct.responses.create(model="tiny", input="Hi there", max_output_tokens=2))
    with running_router(cluster.config()) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        stranger = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-beta", max_retries=0)
        for response in made:
            home = by_instance[instance_of(response.id)]
            raw = client.responses.with_raw_response.retrieve(response.id)
            assert raw.headers[REPLICA_HEADER] == home
            assert raw.parse().model_dump() == response.model_dump()
            items = client.responses.input_items.with_raw_response.list(response.id, limit=1)
            assert items.headers[REPLICA_HEADER] == home
            assert items.parse().data[0].content[0].text == "Hi there"
            with pytest.raises(openai.NotFoundError):
                stranger.responses.retrieve(response.id)  # another tenant's: a 404
            deleted = client.responses.with_raw_response.delete(response.id)
            assert deleted.headers[REPLICA_HEADER] == home
            with pytest.raises(openai.NotFoundError):
                client.responses.retrieve(response.id)


def test_the_router_forwards_priority_on_every_route(cluster: Cluster) -> None:
    bodies = {
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        "/v1/completions": {"prompt": "hi", "max_tokens": 2},
        "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        "/v1/responses": {"input": "hi", "max_output_tokens": 2},
    }
    with running_router(cluster.config()) as (url, _):
        for path, body in bodies.items():
            body = {"model": "tiny", **body}
            ok = loopback.post(url + path, json={**body, "priority": -3}, headers=AUTH)
            assert ok.status_code == 200, path
            refused = loopback.post(url + path, json={**body, "priority": 5000}, headers=AUTH)
            assert refused.status_code == 400 and "priority" in refused.text, path  # replica's
