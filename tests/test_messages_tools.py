"""Tools on the Messages API (tiny model): the same prompt as chat completions, tool_use
blocks out (whole and streamed), a breakpoint on the tools, and the 400s."""

from __future__ import annotations

import json

import anthropic
import pytest

import loopback
from engine_fixtures import assert_pool_clean, tiny_engine
from prefixcache.protocol.anthropic_schemas import AnthropicTool
from prefixcache.protocol.auth import Tenants
from prefixcache.protocol.tool_prompt import tools_block
from prefixcache.server.app import prepare_context
from prefixcache.server.messages import prepare_messages
from prefixcache.server.prepare import prepare_chat
from server_fixtures import running_server, wait_idle

SCHEMA = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOL = {"name": "get_time", "description": "The time now in a zone", "input_schema": SCHEMA}
CHAT_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "The time now in a zone", "parameters": SCHEMA}}  # fmt: skip
SYSTEM = "You tell the time."
ASK = {"role": "user", "content": "What time is it in UTC?"}
USE = {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {"zone": "UTC"}}
RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "12:00"}


def anthropic_body(**extra) -> dict:
    return {
        "model": "tiny", "max_tokens": 40, "system": SYSTEM, "tools": [TOOL],
        "messages": [ASK, {"role": "assistant", "content": [
                         {"type": "text", "text": "Let me see."}, USE]},
                     {"role": "user", "content": [RESULT, {"type": "text", "text": "Thanks!"}]}],
        **extra,
    }  # fmt: skip


def chat_body() -> dict:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}  # fmt: skip
    return {
        "model": "tiny", "max_tokens": 40, "tools": [CHAT_TOOL],
        "messages": [{"role": "system", "content": SYSTEM}, ASK,
                     {"role": "assistant", "content": "Let me see.", "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
                     {"role": "user", "content": "Thanks!"}],
    }  # fmt: skip


def test_the_same_conversation_is_the_same_prompt_through_chat_and_messages():
    ctx = prepare_context(tiny_engine(), "tiny")
    messages = prepare_messages(json.dumps(anthropic_body()).encode(), ctx)
    chat = prepare_chat(json.dumps(chat_body()).encode(), ctx)
    assert messages.prompts == chat.prompts
    assert messages.params.constraint == chat.params.constraint is not None


def test_a_breakpoint_on_the_last_tool_keeps_the_prompt_through_the_tools_block():
    engine = tiny_engine()
    ctx = prepare_context(engine, "tiny")
    marked = {**TOOL, "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    ready = prepare_messages(json.dumps(anthropic_body(tools=[marked])).encode(), ctx)
    function = prepare_messages(json.dumps(anthropic_body()).encode(), ctx)
    assert ready.prompts == function.prompts
    block = tools_block([AnthropicTool.model_validate(TOOL).function()])
    through = engine.tokenizer.encode(f"<|im_start|>system\n{block}")
    (keep,) = ready.retention
    assert keep.retention_class == "1h" and keep.num_tokens == len(through)
    assert ready.prompts[0][: len(through)] == through


def test_a_breakpoint_on_a_tool_result_keeps_the_prompt_through_its_content():
    engine = tiny_engine()
    ctx = prepare_context(engine, "tiny")
    body = anthropic_body()
    body["messages"][2]["content"][0] = {**RESULT, "cache_control": {"type": "ephemeral"}}
    ready = prepare_messages(json.dumps(body).encode(), ctx)
    (keep,) = ready.retention
    through = engine.tokenizer.decode(ready.prompts[0][: keep.num_tokens])
    assert through.endswith("<tool_response>\n12:00") and keep.retention_class == "5m"


@pytest.fixture(scope="module")
def served():
    engine = tiny_engine(num_kv_blocks=128)
    with running_server(engine, Tenants(None)) as (url, state):
        yield url, state
    assert_pool_clean(engine)


def client(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)


def test_any_gives_a_tool_use_block_and_a_stream_reassembles_the_same_input(served):
    url, state = served
    fields = {
        "model": "tiny", "max_tokens": 60, "tools": [TOOL], "messages": [ASK],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "extra_body": {"temperature": 0.0},
    }  # fmt: skip
    reply = client(url).messages.create(**fields)
    assert reply.stop_reason == "tool_use"
    (use,) = [b for b in reply.content if b.type == "tool_use"]
    assert use.id.startswith("toolu_") and use.name == "get_time"
    assert use.input in ({"zone": "UTC"}, {"zone": "CET"})
    with client(url).messages.stream(**fields) as stream:
        kinds = [(e.type, getattr(e, "delta", None)) for e in stream]
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    (streamed,) = [b for b in final.content if b.type == "tool_use"]
    assert streamed.input == use.input and streamed.id.startswith("toolu_")
    fragments = [d.partial_json for kind, d in kinds if kind == "content_block_delta"
                 and d.type == "input_json_delta"]  # fmt: skip
    assert len(fragments) > 1 and json.loads("".join(fragments)) == use.input
    texts = [
        d.text for kind, d in kinds if kind == "content_block_delta" and d.type == "text_delta"
    ]
    assert "<tool_call>" not in "".join(texts)
    wait_idle(state)


def test_a_named_choice_calls_that_tool(served):
    url, state = served
    other = {"name": "get_date", "input_schema": {"type": "object", "properties": {}}}
    reply = client(url).messages.create(
        model="tiny", max_tokens=60, tools=[other, TOOL], messages=[ASK],
        tool_choice={"type": "tool", "name": "get_time"}, extra_body={"temperature": 0.0},
    )  # fmt: skip
    uses = [b for b in reply.content if b.type == "tool_use"]
    assert uses and all(u.name == "get_time" for u in uses)
    wait_idle(state)


def test_a_second_turn_reads_the_first_prompt_from_cache(served):
    url, state = served
    block = loopback.get(url + "/health").json()["block_size"]
    first = client(url).messages.create(
        model="tiny", max_tokens=60, system=SYSTEM, tools=[TOOL], messages=[ASK],
        tool_choice={"type": "any"}, extra_body={"temperature": 0.0},
    )  # fmt: skip
    use = next(b for b in first.content if b.type == "tool_use")
    result = {"type": "tool_result", "tool_use_id": use.id,
              "content": [{"type": "text", "text": "12:00"}]}  # fmt: skip
    turn = [ASK, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
            {"role": "user", "content": [result]}]  # fmt: skip
    second = client(url).messages.create(
        model="tiny", max_tokens=3, system=SYSTEM, tools=[TOOL], messages=turn,
        tool_choice={"type": "none"}, extra_body={"temperature": 0.0},
    )  # fmt: skip
    assert all(b.type == "text" for b in second.content)
    prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens >= (prompt // block - 1) * block
    wait_idle(state)


def test_chat_then_messages_reads_the_chat_prompt_from_cache(served):
    url, state = served
    block = loopback.get(url + "/health").json()["block_size"]
    chat = loopback.post(url + "/v1/chat/completions", json={**chat_body(), "max_tokens": 1})
    prompt = chat.json()["usage"]["prompt_tokens"]
    reply = loopback.post(url + "/v1/messages", json={**anthropic_body(), "max_tokens": 1})
    usage = reply.json()["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == prompt
    assert usage["cache_read_input_tokens"] >= (prompt // block) * block - block
    wait_idle(state)


BAD = [
    ({"tools": [{"name": "bad name", "input_schema": SCHEMA}]}, "tools.0.name"),
    ({"tools": [{"name": "f", "input_schema": {"type": "array"}}]}, "tools.0.input_schema"),
    ({"tools": [{"name": "f"}]}, "tools.0.input_schema"),
    ({"tools": [TOOL, TOOL]}, "tools"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "any", "disable_parallel_tool_use": "yes"}},
     "tool_choice.disable_parallel_tool_use"),
    ({"tools": [], "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"tools": [{**TOOL, "cache_control": {"type": "ephemeral", "ttl": "2h"}}]},
     "tools.0.cache_control.ttl"),
    ({"messages": [ASK, {"role": "user", "content": [{**RESULT, "tool_use_id": "toolu_9"}]}]},
     "messages.1.content.0.tool_use_id"),
    ({"messages": [{"role": "user", "content": [USE]}]}, "messages.0.content.0.type"),
    ({"messages": [ASK, {"role": "assistant", "content": [RESULT]}]}, "messages.1.content.0.type"),
    ({"messages": [ASK, {"role": "assistant", "content": [{**USE, "input": [1]}]}]},
     "messages.1.content.0.input"),
    ({"messages": [ASK, {"role": "assistant", "content": [{**USE, "id": ""}]}]},
     "messages.1.content.0.id"),
    ({"messages": [ASK, {"role": "assistant", "content": [USE]},
                   {"role": "user", "content": [{**RESULT, "is_error": "no"}]}]},
     "messages.2.content.0.is_error"),
    ({"messages": [ASK, {"role": "assistant", "content": [USE]},
                   {"role": "user", "content": [{**RESULT, "content": [{"type": "image"}]}]}]},
     "messages.2.content.0.content.0.type"),
]  # fmt: skip


@pytest.mark.parametrize(("change", "field"), BAD, ids=[field for _, field in BAD])
def test_bad_tool_fields_are_400s_naming_the_field(served, change, field):
    url, state = served
    body = {"model": "tiny", "max_tokens": 2, "messages": [ASK], "tools": [TOOL], **change}
    reply = loopback.post(f"{url}/v1/messages", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{field}:"), error
    wait_idle(state)
