"""Tools on the Messages API on the real default model, through the anthropic SDK
unchanged: forced and named calls (a named one is one call, even after a long system prompt),
a streamed call, a cached tool_use → tool_result loop."""

from __future__ import annotations

import anthropic
import pytest

import loopback
from engine_fixtures import default_engine
from prefixcache.protocol.auth import Tenants
from server_fixtures import running_server, wait_idle
from test_tools_default_model import LONG_SYSTEM

MODEL = "smollm2"
WEATHER = {
    "name": "get_weather",
    "description": "The weather now in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
TIME = {
    "name": "get_time",
    "input_schema": {
        "type": "object",
        "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"],
        "additionalProperties": False,
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
ONE = {"type": "any", "disable_parallel_tool_use": True}


@pytest.fixture(scope="module")
def served():
    with running_server(default_engine(), Tenants(None), model_name=MODEL) as (url, state):
        block = loopback.get(url + "/health").json()["block_size"]
        yield anthropic.Anthropic(base_url=url, api_key="none", max_retries=0), block
        wait_idle(state)


def fields(messages: list, **extra) -> dict:
    return {
        "model": MODEL, "max_tokens": 40, "messages": messages, "tools": [WEATHER, TIME],
        "extra_body": {"temperature": 0}, **extra,
    }  # fmt: skip


def _valid(use) -> dict:
    """The tool_use input, checked against its tool's schema by hand."""
    if use.name == "get_weather":
        assert set(use.input) == {"city"} and isinstance(use.input["city"], str)
        assert len(use.input["city"]) <= 20
    else:
        assert use.input in ({"zone": "UTC"}, {"zone": "CET"})
    return use.input


def test_any_and_named_choices_give_valid_tool_use_blocks(served):
    api, _ = served
    reply = api.messages.create(**fields(ASK, tool_choice=ONE))
    assert reply.stop_reason == "tool_use"
    (use,) = reply.content
    assert use.type == "tool_use" and use.id.startswith("toolu_")
    _valid(use)
    named = api.messages.create(**fields(ASK, tool_choice={"type": "tool", "name": "get_time"}))
    (named_use,) = named.content
    assert named_use.type == "tool_use" and named_use.name == "get_time"
    _valid(named_use)


def test_a_named_tool_is_one_tool_use_after_a_long_system_prompt(served):
    api, _ = served
    named = {"type": "tool", "name": "get_weather"}
    reply = api.messages.create(
        **fields(ASK, tool_choice=named, system=LONG_SYSTEM, max_tokens=120)
    )
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens > 600
    assert reply.stop_reason == "tool_use"
    (use,) = reply.content
    assert use.type == "tool_use" and use.name == "get_weather"
    _valid(use)


def test_a_streamed_tool_use_reassembles_into_the_same_input(served):
    api, _ = served
    whole = api.messages.create(**fields(ASK, tool_choice=ONE))
    with api.messages.stream(**fields(ASK, tool_choice=ONE)) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert deltas and all(d.type == "input_json_delta" for d in deltas)
    assert final.stop_reason == "tool_use"
    (use,) = final.content
    assert (use.name, use.input) == (whole.content[0].name, whole.content[0].input)


def test_a_tool_use_then_tool_result_loop_reads_the_first_prompt_from_cache(served):
    api, block = served
    first = api.messages.create(**fields(ASK, tool_choice=ONE))
    (use,) = first.content
    messages = [
        *ASK,
        {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": '{"celsius": 18, "sky": "clear"}'}]},
    ]  # fmt: skip
    second = api.messages.create(**fields(messages, max_tokens=8))
    assert second.content and second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens >= (prompt // block - 1) * block


def test_a_tool_use_cut_by_max_tokens_stops_at_max_tokens(served):
    client, _ = served
    named = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    whole = client.messages.create(**fields(ASK, tool_choice=named))
    assert whole.stop_reason == "tool_use"
    half = fields(ASK, tool_choice=named, max_tokens=whole.usage.output_tokens // 2)
    cut = client.messages.create(**half)
    assert cut.stop_reason == "max_tokens"
    assert all(block.type == "text" and "<tool_call>" not in block.text for block in cut.content)
    with client.messages.stream(**half) as stream:
        assert stream.get_final_message().stop_reason == "max_tokens"
