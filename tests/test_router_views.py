"""The router scores a prompt by the token ids the replica will compute, tools included."""

from __future__ import annotations

import json

import pytest

from engine_fixtures import default_tokenizer
from prefixcache.router.prompts import CHAT, MESSAGES, routing_view
from prefixcache.server.messages import prepare_messages
from prefixcache.server.prepare import PrepareContext, prepare_chat

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
CHAT_BODY = {
    "model": "m",
    "tools": [{"type": "function", "function": WEATHER}],
    "messages": [
        {"role": "system", "content": "You help."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
        }]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 4}'},
        {"role": "user", "content": "And Lima?"},
    ],
}  # fmt: skip
MESSAGES_BODY = {
    "model": "m",
    "max_tokens": 8,
    "system": "You help.",
    "tools": [{"name": "get_weather", "description": WEATHER["description"],
               "input_schema": WEATHER["parameters"]}],
    "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": '{"celsius": 4}'},
            {"type": "text", "text": "And Lima?"},
        ]},
    ],
}  # fmt: skip


@pytest.mark.parametrize(
    ("endpoint", "body", "prepare"),
    [(CHAT, CHAT_BODY, prepare_chat), (MESSAGES, MESSAGES_BODY, prepare_messages)],
)
def test_the_router_sees_the_replicas_prompt_for_a_conversation_with_tools(endpoint, body, prepare):
    tokenizer = default_tokenizer()
    ctx = PrepareContext(tokenizer, "m", 2048, tokenizer.vocab_size, 100_000)
    raw = json.dumps(body).encode()
    replica_prompt = prepare(raw, ctx).prompts[0]
    view = routing_view(raw, endpoint, tokenizer)
    assert view.token_ids == replica_prompt
    assert "get_weather" in tokenizer.decode(view.token_ids)  # the tools are in the prompt
