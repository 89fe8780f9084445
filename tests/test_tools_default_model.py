"""Tool calls end to end on the real default model, through the openai SDK unchanged:
grammar-forced calls, a streamed call, a cached three-turn loop, the Responses round trip,
and a named choice that is one call even after a long system prompt."""

from __future__ import annotations

import json

import openai
import pytest

import loopback
from engine_fixtures import default_engine
from prefixcache.protocol.auth import Tenants
from server_fixtures import running_server, wait_idle

MODEL = "smollm2"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather now in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
LONG_SYSTEM = " ".join(
    [
        "You are a careful assistant for a travel company.",
        "You answer questions about the weather, the local time and the travel plans of our",
        "customers. Be concise, polite and accurate; never invent facts; when unsure, use a tool.",
        "Our customers travel across Europe, mostly to Paris, Rome, Berlin, Oslo and Madrid.",
    ]
    * 12
)  # ~800 tokens: after a long system prompt the model, allowed to, repeats a call
LONG_ASK = [{"role": "system", "content": LONG_SYSTEM}, *ASK]
NAMED_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def served():
    with running_server(default_engine(), Tenants(None), model_name=MODEL) as (url, state):
        block = loopback.get(url + "/health").json()["block_size"]
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0), block
        wait_idle(state)


def chat(api: openai.OpenAI, messages: list, **fields):
    fields = {"max_tokens": 40, "temperature": 0, **fields}
    return api.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER, TIME], **fields
    )


def _valid(call) -> dict:
    """The call's arguments, checked against its tool's schema by hand."""
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(arguments) == {"city"} and isinstance(arguments["city"], str)
        assert len(arguments["city"]) <= 20
    else:
        assert arguments in ({"zone": "UTC"}, {"zone": "CET"})
    return arguments


def test_required_and_named_choices_call_with_valid_arguments(served):
    api, _ = served
    required = chat(api, ASK, tool_choice="required", parallel_tool_calls=False)
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    _valid(call)
    named = chat(api, ASK, tool_choice={"type": "function", "function": {"name": "get_time"}})
    (named_call,) = named.choices[0].message.tool_calls
    assert named_call.function.name == "get_time"
    _valid(named_call)


def test_a_named_choice_is_one_call_after_a_long_system_prompt(served):
    api, _ = served
    for name in ("get_weather", "get_time"):
        choice = {"type": "function", "function": {"name": name}}
        reply = chat(api, LONG_ASK, tool_choice=choice, max_tokens=120)
        assert reply.usage.prompt_tokens > 600
        message = reply.choices[0].message
        (call,) = message.tool_calls
        assert call.function.name == name and message.content is None
        assert reply.choices[0].finish_reason == "tool_calls"
        _valid(call)


def test_a_streamed_named_choice_is_one_call_after_a_long_system_prompt(served):
    api, _ = served
    chunks = list(chat(api, LONG_ASK, tool_choice=NAMED_WEATHER, max_tokens=120, stream=True))
    calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert {t.index for t in calls} == {0}
    assert [t.function.name for t in calls if t.function.name] == ["get_weather"]
    arguments = json.loads("".join(t.function.arguments or "" for t in calls))
    assert set(arguments) == {"city"} and isinstance(arguments["city"], str)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_named_responses_choice_is_one_call_after_a_long_system_prompt(served):
    api, _ = served
    reply = api.responses.create(
        model=MODEL,
        instructions=LONG_SYSTEM,
        input="Weather in Rome?",
        tools=[{"type": "function", **WEATHER["function"]}],
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
        max_output_tokens=120,
    )
    assert reply.usage.input_tokens > 600
    (item,) = reply.output
    assert item.type == "function_call" and item.name == "get_weather"
    assert isinstance(json.loads(item.arguments)["city"], str)


def test_a_streamed_call_reassembles_into_the_same_call(served):
    api, _ = served
    whole = chat(api, ASK, tool_choice="required", parallel_tool_calls=False)
    (expected,) = whole.choices[0].message.tool_calls
    chunks = list(chat(api, ASK, tool_choice="required", parallel_tool_calls=False, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not any(d.content for d in deltas)
    calls = [t for d in deltas for t in d.tool_calls or []]
    assert calls[0].id.startswith("call_") and calls[0].function.name == expected.function.name
    assert len(calls) > 2 and all(t.index == 0 for t in calls)
    assert "".join(t.function.arguments or "" for t in calls) == expected.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_three_turn_tool_loop_stays_cached(served):
    api, block = served
    messages = list(ASK)
    first = chat(api, messages, tool_choice="required", parallel_tool_calls=False)
    (call,) = first.choices[0].message.tool_calls
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 18, "sky": "clear"}'},
    ]
    second = chat(api, messages, tool_choice="auto", max_tokens=8)
    messages += [
        {"role": "assistant", "content": second.choices[0].message.content or ""},
        {"role": "user", "content": "And the time in UTC?"},
    ]
    third = chat(api, messages, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert third.choices[0].message.tool_calls[0].function.name == "get_time"
    for before, after in ((first, second), (second, third)):
        covered = (before.usage.prompt_tokens // block - 1) * block
        assert after.usage.prompt_tokens_details.cached_tokens >= covered


def test_responses_function_call_round_trip(served):
    api, block = served
    tool = {"type": "function", **WEATHER["function"]}
    first = api.responses.create(
        model=MODEL,
        instructions="You answer weather questions with the tool.",
        input="Weather in Rome?",
        tools=[tool],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_output_tokens=40,
    )
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.status == "completed"
    assert isinstance(json.loads(call.arguments)["city"], str)
    second = api.responses.create(
        model=MODEL,
        instructions="You answer weather questions with the tool.",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "20 C"}],
        tools=[tool],
        tool_choice="none",
        temperature=0,
        max_output_tokens=8,
    )
    assert second.output[0].type == "message" and second.output_text
    covered = (first.usage.input_tokens // block - 1) * block
    assert second.usage.input_tokens_details.cached_tokens >= covered


def test_a_streamed_responses_call_matches_its_final_item(served):
    api, _ = served
    tool = {"type": "function", **WEATHER["function"]}
    events = list(
        api.responses.create(
            model=MODEL,
            input="Weather in Oslo?",
            tools=[tool],
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0,
            max_output_tokens=64,  # the grammar lets up to 16 newlines follow the call
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-2:] == ["response.output_item.done", "response.completed"]
    assert "response.output_text.delta" not in kinds
    fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    (item,) = events[-1].response.output
    assert item.type == "function_call" and item.name == "get_weather"
    assert "".join(fragments) == done.arguments == item.arguments
    assert isinstance(json.loads(item.arguments)["city"], str)
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_call_cut_by_max_tokens_finishes_length_and_one_just_complete_stands(served):
    api, _ = served
    whole = chat(api, ASK, tool_choice=NAMED_WEATHER, parallel_tool_calls=False)
    assert whole.choices[0].finish_reason == "tool_calls"
    (call,) = whole.choices[0].message.tool_calls
    used = whole.usage.completion_tokens  # the call, then the end-of-turn token
    just = chat(api, ASK, tool_choice=NAMED_WEATHER, parallel_tool_calls=False,
                max_tokens=used - 1)  # fmt: skip
    ended = just.choices[0]
    assert ended.finish_reason == "tool_calls"  # cut after its last tag: the call is whole
    assert [c.function.arguments for c in ended.message.tool_calls] == [call.function.arguments]
    for stream in (False, True):
        fields = {"tool_choice": NAMED_WEATHER, "max_tokens": used // 2}
        if stream:
            chunks = list(chat(api, ASK, stream=True, **fields))
            reason = chunks[-1].choices[0].finish_reason
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            cut = chat(api, ASK, **fields).choices[0]
            reason, content = cut.finish_reason, cut.message.content or ""
            assert not cut.message.tool_calls  # a half-written call is not a call
        assert reason == "length" and "<tool_call>" not in content and "{" not in content
