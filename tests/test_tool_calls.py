"""Tool calls: the generic prompt, parsing and streaming the calls, turns, and the 400s."""

from __future__ import annotations

import json

import pytest

import loopback
from engine_fixtures import default_tokenizer, tiny_engine
from prefixcache.engine.request import CompletionOutput, RequestMetrics, RequestOutput
from prefixcache.engine.tokenizer import Tokenizer
from prefixcache.protocol.auth import Tenants
from prefixcache.protocol.tool_prompt import Call, Turn, render
from prefixcache.protocol.tool_schemas import FunctionDef
from prefixcache.server import openai_format
from prefixcache.server.tool_parse import ToolStream, scan
from server_fixtures import running_server

WEATHER = FunctionDef(
    name="get_weather",
    description="Weather now in a city",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}},
)
NAMES = frozenset({"get_weather"})
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def test_scan_splits_content_and_calls_and_keeps_malformed_tags_as_content():
    found = scan("Let me look." + CALL, NAMES, final=True)
    assert found.content == "Let me look."
    assert [(c.name, c.arguments) for c in found.calls] == [("get_weather", '{"city": "Paris"}')]
    bad = '<tool_call>{"name": "other", "arguments": {}}</tool_call>'
    assert scan(bad, NAMES, final=True).content == bad
    broken = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    assert scan(broken, NAMES, final=True).calls == []
    reordered = '<tool_call>{"arguments": {"city": "Oslo"}, "name": "get_weather"}</tool_call>'
    assert scan(reordered, NAMES, final=True).calls[0].arguments == '{"city": "Oslo"}'
    assert scan("Hi <tool_c", NAMES, final=False).content == "Hi "  # could be the tag
    assert scan("Hi <tool_c", NAMES, final=True).content == "Hi <tool_c"


def test_streamed_events_reassemble_into_the_final_call():
    text = "Sure." + CALL + CALL.replace("Paris", "Rome")
    stream = ToolStream(NAMES)
    events = []
    for end in range(1, len(text) + 1):
        events += stream.update(text[:end], final=end == len(text))
    content = "".join(e[1] for e in events if e[0] == "text")
    assert content == "Sure." and "<" not in content
    opened = [e for e in events if e[0] == "call"]
    assert [e[1] for e in opened] == [0, 1] and all(e[3] == "get_weather" for e in opened)
    for index, city in enumerate(["Paris", "Rome"]):
        fragments = [e[2] for e in events if e[0] == "arguments" and e[1] == index]
        assert len(fragments) > 1 and json.loads("".join(fragments)) == {"city": city}


def _output(text: str, finished: bool) -> RequestOutput:
    completion = CompletionOutput(0, text, [], finish_reason="stop" if finished else None)
    return RequestOutput("r", [1, 2], [completion], 0, RequestMetrics(0.0), finished)


def test_chat_message_and_stream_chunks_in_openai_shape():
    shape = openai_format.Shape("chatcmpl-x", "m", True, 1, default_tokenizer())
    shape.tool_names = NAMES
    final = openai_format.response(shape, [_output(CALL, True)])["choices"][0]
    assert final["finish_reason"] == "tool_calls" and final["message"]["content"] is None
    (call,) = final["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    formatter = openai_format.StreamFormatter(shape)
    chunks = []
    for end in range(0, len(CALL), 7):
        chunks += formatter.chunks(_output(CALL[:end], False))
    chunks += formatter.chunks(_output(CALL, True))
    deltas = [json.loads(c.removeprefix("data: "))["choices"][0] for c in chunks]
    assert not any(d["delta"].get("content") for d in deltas)
    calls = [t for d in deltas for t in d["delta"].get("tool_calls", [])]
    assert calls[0]["id"].startswith("call_") and calls[0]["function"]["arguments"] == ""
    assert "".join(t["function"]["arguments"] for t in calls) == '{"city": "Paris"}'
    assert deltas[-1]["finish_reason"] == "tool_calls"


def _cut_output(text: str, finished: bool) -> RequestOutput:
    """A completion that max_tokens ended (finish_reason "length")."""
    completion = CompletionOutput(0, text, [], finish_reason="length" if finished else None)
    return RequestOutput("r", [1, 2], [completion], 0, RequestMetrics(0.0), finished)


HALF = CALL[: CALL.index("Paris") + 2]  # cut inside the arguments


@pytest.mark.parametrize(
    "text, reason, calls, content",
    [
        (CALL, "tool_calls", 1, None),  # cut right after a complete call: the call stands
        ("Let me see." + HALF, "length", 0, "Let me see."),  # cut inside the only call
        (CALL + HALF, "length", 1, None),  # the second call cut: it is dropped
        ("Let me see. <tool_c", "length", 0, "Let me see. "),  # cut inside the tag
        ('Hm.<tool_call>{"name": "get_weath', "length", 0, "Hm."),  # inside the name
    ],
)
def test_a_call_cut_by_max_tokens_finishes_length_and_leaks_no_markup(text, reason, calls,
                                                                      content):  # fmt: skip
    shape = openai_format.Shape("chatcmpl-x", "m", True, 1, default_tokenizer())
    shape.tool_names = NAMES
    choice = openai_format.response(shape, [_cut_output(text, True)])["choices"][0]
    assert choice["finish_reason"] == reason
    assert len(choice["message"].get("tool_calls", [])) == calls
    assert choice["message"]["content"] == content
    formatter = openai_format.StreamFormatter(shape)
    chunks = []
    for end in range(0, len(text), 5):
        chunks += formatter.chunks(_cut_output(text[:end], False))
    chunks += formatter.chunks(_cut_output(text, True))
    deltas = [json.loads(c.removeprefix("data: "))["choices"][0] for c in chunks]
    assert deltas[-1]["finish_reason"] == reason
    streamed = "".join(d["delta"].get("content") or "" for d in deltas)
    assert streamed == (content or "") and "<" not in streamed


def test_generic_prompt_lists_tools_and_each_turn_extends_the_last():
    tokenizer = default_tokenizer()
    turns = [Turn("user", "Weather in Paris?")]
    first = render(tokenizer, turns, [WEATHER])
    assert '"name": "get_weather"' in first and "<tool_call>" in first
    assert first.startswith("<|im_start|>system\nYou can call these functions")
    output = CALL
    turns += [
        Turn("assistant", "", [Call("call_1", "get_weather", '{"city": "Paris"}')]),
        Turn("tool", "18 C, sunny", call_id="call_1"),
    ]
    second = render(tokenizer, turns, [WEATHER])
    assert second.startswith(first + output + "<|im_end|>\n<|im_start|>user\n<tool_response>")
    with_system = render(tokenizer, [Turn("system", "Be brief."), *turns[:1]], [WEATHER])
    assert with_system.count("<|im_start|>system") == 1 and "Be brief." in with_system


def test_a_template_with_a_tool_section_renders_the_tools_itself():
    template = (
        "{% for t in tools %}[TOOL {{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
        "{% for c in m.tool_calls or [] %}[CALL {{ c.function.arguments | tojson }}]{% endfor %}"
        "{% endfor %}"
    )
    base = default_tokenizer()
    tokenizer = Tokenizer(base.backend, chat_template=template)
    turns = [
        Turn("user", "hi"),
        Turn("assistant", "", [Call("c1", "get_weather", '{"city": "Oslo"}')]),
    ]
    text = render(tokenizer, turns, [WEATHER])
    assert text == '[TOOL get_weather]<user>hi<assistant>[CALL {"city": "Oslo"}]'


@pytest.fixture(scope="module")
def served():
    with running_server(tiny_engine(num_kv_blocks=128), Tenants(None)) as (url, _):
        yield url


TOOL = {"type": "function", "function": WEATHER.model_dump(exclude_none=True)}
ASK = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"tools": [{"type": "function", "function": {"description": "x"}}]},
         "tools.0.function.name"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
         "tools.0.function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"type": "nope"}}}}}]},
         "tools.0.function.parameters"),
        ({"tools": [TOOL, TOOL]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"d": {"type": "string", "format": "no-such"}}}}}]},
         "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "description": "x" * 70000}}}]}, "tools.0.function.parameters"),
        ({"tools": [TOOL], "response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
        ({"messages": [*ASK, {"role": "tool", "content": "x", "tool_call_id": "call_9"}]},
         "messages.1.tool_call_id"),
        ({"messages": [*ASK, {"role": "tool", "content": "x"}]}, "messages.1.tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": "c",
            "function": {"name": "f", "arguments": "{}"}}]}]}, "messages.0.tool_calls"),
        ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
            "function": {"name": "f", "arguments": "[1]"}}]}]},
         "messages.1.tool_calls.0.function.arguments"),
    ],
)  # fmt: skip
def test_bad_tools_are_400s_naming_the_field(served, extra, field):
    body = {"model": "tiny", "messages": ASK, "max_tokens": 2, **extra}
    reply = loopback.post(served + "/v1/chat/completions", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == field and field in error["message"], error


def test_tool_choice_none_renders_the_tools_and_answers_in_text(served):
    body = {
        "model": "tiny",
        "messages": [
            *ASK,
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "cold"},
        ],
        "tools": [TOOL],
        "tool_choice": "none",
        "max_tokens": 3,
        "temperature": 0,
    }  # fmt: skip
    reply = loopback.post(served + "/v1/chat/completions", json=body, timeout=30)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] != "tool_calls"
