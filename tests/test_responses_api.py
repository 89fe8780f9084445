"""POST /v1/responses on the tiny model, driven by the openai SDK: store, stream, 400s."""

from __future__ import annotations

import openai
import pytest

import loopback
from engine_fixtures import tiny_engine
from prefixcache.protocol.auth import Tenants
from prefixcache.protocol.tool_prompt import Turn
from prefixcache.server.response_store import Record, ResponseStore
from server_fixtures import running_server, wait_idle, write_key_file

INSTRUCTIONS = "You are a terse railway clerk. " * 4


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    engine = tiny_engine(num_kv_blocks=256, block_size=4)
    tenants = Tenants.from_file(write_key_file(tmp_path_factory.mktemp("keys")))
    with running_server(engine, tenants) as (url, state):
        yield url, state


def client(url: str, key: str = "sk-alpha") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def ask(api: openai.OpenAI, **fields):
    return api.responses.create(model="tiny", max_output_tokens=3, temperature=0, **fields)


def test_instructions_then_previous_response_id_reuses_the_conversation(served):
    url, state = served
    api = client(url)
    first = ask(api, instructions=INSTRUCTIONS, input="Next train to Bern?")
    assert first.object == "response" and first.status == "incomplete"
    assert first.output[0].type == "message" and first.output[0].content[0].type == "output_text"
    assert first.usage.output_tokens == 3 and first.output_text == first.output[0].content[0].text
    second = ask(
        api, instructions=INSTRUCTIONS, input="And to Basel?", previous_response_id=first.id
    )
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens
    block = state.engine.manager.block_size
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= (first.usage.input_tokens // block - 1) * block
    wait_idle(state)


def test_another_tenant_and_store_false_ids_are_404(served):
    url, _ = served
    mine = ask(client(url), input="hello")
    with pytest.raises(openai.NotFoundError) as caught:
        ask(client(url, "sk-beta"), input="hi", previous_response_id=mine.id)
    assert caught.value.body["param"] == "previous_response_id"
    unstored = ask(client(url), input="hello", store=False)
    with pytest.raises(openai.NotFoundError):
        ask(client(url), input="hi", previous_response_id=unstored.id)


def test_streamed_events_in_order_with_sequence_numbers(served):
    url, _ = served
    events = list(ask(client(url), input="hello", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == 3


def test_a_function_call_round_trip_renders_and_answers(served):
    url, _ = served
    reply = ask(
        client(url),
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
            {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ],
        tools=[{"type": "function", "name": "weather", "parameters": {"type": "object"}}],
        tool_choice="none",
    )
    assert reply.output[0].type == "message"


@pytest.mark.parametrize(
    "body, field",
    [
        ({"input": [{"type": "function_call_output", "call_id": "x", "output": "o"}]},
         "input.0.call_id"),
        ({"input": [{"type": "image", "url": "x"}]}, "input.0.type"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input.0.role"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "1"}]},
         "input.0.arguments"),
        ({"input": "x", "tools": [{"type": "function", "name": "bad name"}]}, "tools.0.name"),
        ({"input": "x", "tools": [{"type": "function", "name": "f"}],
          "tool_choice": {"type": "function", "name": "g"}}, "tool_choice"),
        ({"input": 5}, "input"),
        ({"input": "x", "max_output_tokens": 100000}, "max_output_tokens"),
        ({"input": "x", "prompt_cache_retention": "forever"}, "prompt_cache_retention"),
        ({"input": "x", "prompt_cache_key": 7}, "prompt_cache_key"),
        ({"input": "x", "prompt_cache_key": "k" * 257}, "prompt_cache_key"),
    ],
)  # fmt: skip
def test_bad_bodies_are_400s_naming_the_field(served, body, field):
    url, _ = served
    reply = loopback.post(
        url + "/v1/responses",
        json={"model": "tiny", **body},
        headers={"authorization": "Bearer sk-alpha"},
        timeout=30,
    )
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == field, reply.text


def test_the_store_is_bounded_per_tenant_and_expires():
    now = [0.0]
    store = ResponseStore(max_per_tenant=2, ttl=10.0, max_chars=40, clock=lambda: now[0])
    turn = [Turn("user", "abc")]
    for name in ("a", "b", "c"):
        store.put("t1", name, Record(turn, (1, 1), {}))
    assert store.get("t1", "a") is None and store.get("t1", "c") is not None
    assert store.get("t2", "c") is None  # another tenant's id
    big = Record([Turn("user", "x" * 25)], (1, 1), {})  # 33 characters with its object
    store.put("t1", "big", big)  # over the characters: the rest go
    assert store.get("t1", "b") is None and store.get("t1", "c") is None
    assert store.get("t1", "big") is not None
    now[0] = 11.0
    assert store.get("t1", "big") is None


def test_a_previous_output_can_come_back_as_input_items(served):
    url, _ = served
    api = client(url)
    first = ask(api, input="hello")
    items = [item.model_dump(exclude_none=True) for item in first.output]
    second = ask(api, input=[{"role": "user", "content": "hello"}, *items, {
        "role": "user", "content": "again"}])  # fmt: skip
    assert second.status in ("completed", "incomplete") and second.output[0].type == "message"


def test_prompt_cache_retention_keeps_a_responses_prompt(served):
    url, state = served
    api = client(url)
    before = state.engine.manager.retained_blocks()
    instructions = "Keep this instruction block cached for a day. " * 4
    api.responses.create(
        model="tiny", instructions=instructions, input="hi", max_output_tokens=2,
        prompt_cache_retention="24h", prompt_cache_key="my-agent",
    )  # fmt: skip
    wait_idle(state)
    assert state.engine.manager.retained_blocks() > before


def test_the_openai_sdk_retrieves_lists_and_deletes_a_stored_response(served):
    url, _ = served
    api = client(url)
    items = [
        {"role": "user", "content": "Weather?"},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"role": "user", "content": [{"type": "input_text", "text": "And tomorrow?"}]},
    ]
    made = ask(api, input=items, instructions=INSTRUCTIONS)
    got = api.responses.retrieve(made.id)
    assert got.model_dump() == made.model_dump()  # the object as it was answered
    listed = api.responses.input_items.list(made.id, order="asc")
    kinds = [(i.type, getattr(i, "role", None)) for i in listed.data]
    assert kinds == [("message", "user"), ("function_call", None),
                     ("function_call_output", None), ("message", "user")]  # fmt: skip
    assert listed.data[1].call_id == "c1" and listed.data[2].output == "sunny"
    assert listed.data[3].content[0].text == "And tomorrow?"
    newest = api.responses.input_items.list(made.id, limit=3)  # desc by default, as OpenAI's
    assert [i.id for i in newest.data] == [i.id for i in reversed(listed.data)][:3]
    assert newest.has_more
    pages = list(api.responses.input_items.list(made.id, limit=1, order="asc"))  # auto-paging
    assert [i.id for i in pages] == [i.id for i in listed.data]
    assert api.responses.delete(made.id) is None
    for call in (lambda: api.responses.retrieve(made.id),
                 lambda: api.responses.input_items.list(made.id),
                 lambda: api.responses.delete(made.id),
                 lambda: ask(api, input="more", previous_response_id=made.id)):  # fmt: skip
        with pytest.raises(openai.NotFoundError):
            call()


def test_another_tenants_response_is_a_404_like_an_unknown_one(served):
    url, _ = served
    mine = ask(client(url), input="hello")
    theirs = client(url, "sk-beta")
    answers = []
    for response_id in (mine.id, "resp_" + "0" * 32):
        for call in (theirs.responses.retrieve, theirs.responses.delete,
                     theirs.responses.input_items.list):  # fmt: skip
            with pytest.raises(openai.NotFoundError) as caught:
                call(response_id)
            answers.append(caught.value.body["message"].replace(response_id, "ID"))
    assert len(set(answers)) == 1  # nothing tells another tenant's id from an unknown one
    assert client(url).responses.retrieve(mine.id).id == mine.id  # still there for its tenant
    unstored = ask(client(url), input="hello", store=False)
    with pytest.raises(openai.NotFoundError):
        client(url).responses.retrieve(unstored.id)


@pytest.mark.parametrize(
    "query, param",
    [("limit=0", "limit"), ("limit=101", "limit"), ("limit=x", "limit"), ("order=up", "order"),
     ("after=msg_nope", "after")],
)  # fmt: skip
def test_bad_input_item_queries_are_400s_naming_the_parameter(served, query, param):
    url, _ = served
    made = ask(client(url), input="hello")
    reply = loopback.get(
        f"{url}/v1/responses/{made.id}/input_items?{query}",
        headers={"authorization": "Bearer sk-alpha"},
    )
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text
    streamed = loopback.get(
        f"{url}/v1/responses/{made.id}?stream=true", headers={"authorization": "Bearer sk-alpha"}
    )
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "stream"


def test_a_deleted_response_gives_back_its_characters():
    store = ResponseStore(max_chars=100)
    store.put("t1", "a", Record([Turn("user", "abc")], (1, 1), {"id": "a"}))
    assert store.delete("t1", "a") and not store.delete("t1", "a")
    assert not store.delete("t2", "a")
    store.put("t1", "b", Record([Turn("user", "x" * 80)], (1, 1), {}))  # fits only if freed
    assert store.get("t1", "b") is not None
