"""What routing needs from a request body: stream or not, the client salt, the prompt's
``prompt_cache_key`` (key affinity), the instance part of a ``previous_response_id``, the
prompt's token ids.

The replica is the authority on what it accepts: the router refuses only a body the
replica's strict JSON parser refuses (``protocol/json_body.load_json``: the same 400s,
the same messages) and forwards anything else, so a bad field or an unknown model gets the
replica's own error. It runs on a worker thread, never on the router's event loop. When it
can, it tokenizes the prompt exactly as the replica will (``server/prepare.py``): chat's
and the Messages API's conversations, tools, calls and results included, through
``protocol/tool_prompt.render`` (the replica's own renderer), ``encode(prompt,
add_special_tokens=True)`` or the ids as sent for text completions (the first prompt of a
batch: the whole request goes to one replica); for the Responses API, ``instructions`` and
``input``'s message text through the chat template (input with calls or their outputs is
not scored). A ``previous_response_id`` request is not scored (its prompt is on the
replica it names).
"""

from __future__ import annotations

from typing import NamedTuple

from pydantic import ValidationError

from prefixcache.engine.tokenizer import Tokenizer
from prefixcache.protocol import tool_prompt
from prefixcache.protocol.anthropic_blocks import conversation
from prefixcache.protocol.anthropic_schemas import MessagesRequest
from prefixcache.protocol.errors import ApiError
from prefixcache.protocol.json_body import load_json
from prefixcache.protocol.response_ids import instance_of
from prefixcache.protocol.schemas import ChatCompletionRequest

CHAT, COMPLETIONS, MESSAGES, RESPONSES = "chat", "completions", "messages", "responses"
TEXT_PARTS = ("input_text", "output_text", "text")


class RoutingView(NamedTuple):
    """The parts of a body routing reads; ``token_ids`` None when unknown or not needed."""

    stream: bool
    cache_salt: str | None
    token_ids: list[int] | None
    cache_key: str | None = None  # ``prompt_cache_key``: never logged (routes digest it)
    instance: str | None = None  # the replica that issued its ``previous_response_id``


def routing_view(raw: bytes, endpoint: str, tokenizer: Tokenizer | None) -> RoutingView:
    """Stream flag, client salt and (given a tokenizer) the prompt's ids, as a replica reads;
    ApiError(400) where the replica's parser would refuse the body. ``endpoint``: ``CHAT``,
    ``COMPLETIONS``, ``MESSAGES`` or ``RESPONSES``."""
    data = load_json(raw)
    salt = data.get("cache_salt")
    stream = data.get("stream") is True
    salt = salt if isinstance(salt, str) else None
    key = data.get("prompt_cache_key")
    key = key if isinstance(key, str) and key else None
    previous = data.get("previous_response_id") if endpoint == RESPONSES else None
    instance = instance_of(previous)
    if tokenizer is None or previous is not None:
        return RoutingView(stream, salt, None, key, instance)
    return RoutingView(stream, salt, VIEWS[endpoint](data, tokenizer), key, instance)


def chat_ids(data: dict, tokenizer: Tokenizer) -> list[int] | None:
    """The messages (tools, calls and results included) as the replica renders them; None
    if the replica would refuse them."""
    try:
        body = ChatCompletionRequest.model_validate(data)
        if not body.messages:
            return None
        tools = [tool.function for tool in body.tools]
        text = tool_prompt.render(tokenizer, tool_prompt.chat_turns(body.messages), tools)
        return tokenizer.encode(text)
    except (ValidationError, ApiError, ValueError, TypeError):
        return None


def messages_ids(data: dict, tokenizer: Tokenizer) -> list[int] | None:
    """A Messages body's system and turns through the chat template, as the replica
    renders them; None if the replica would refuse the body."""
    try:
        body = MessagesRequest.model_validate(data)
        turns, _ = conversation(body)
        tools = [tool.function() for tool in body.tools]
        return tokenizer.encode(tool_prompt.render(tokenizer, turns, tools))
    except (ValidationError, ApiError, ValueError, TypeError):
        return None


def responses_ids(data: dict, tokenizer: Tokenizer) -> list[int] | None:
    """``instructions`` and ``input``'s messages through the chat template; None for input
    with other items (calls, their outputs) or anything the replica would refuse."""
    value, instructions = data.get("input"), data.get("instructions")
    items = [{"role": "user", "content": value}] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not isinstance(instructions, str | None):
        return None
    messages = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        text = _message_text(item)
        if text is None:
            return None
        messages.append({"role": item["role"], "content": text})
    try:
        return tokenizer.encode_chat(messages)
    except (ValueError, TypeError):
        return None


def _message_text(item: object) -> str | None:
    """A Responses ``message`` item's text (a string or text parts); None otherwise."""
    if not isinstance(item, dict) or item.get("type", "message") != "message":
        return None
    if item.get("role") not in ("user", "assistant", "system", "developer"):
        return None
    content = item.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") in TEXT_PARTS]
    ok = len(texts) == len(content) and all(isinstance(t, str) for t in texts)
    return "".join(texts) if ok else None


def completion_ids(data: dict, tokenizer: Tokenizer) -> list[int] | None:
    """The (first) prompt's ids: a string encoded with special tokens, or ids as sent."""
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt and not _is_ids(prompt):
        prompt = prompt[0]  # a batch: route on its first prompt
    if isinstance(prompt, str) and prompt:
        return tokenizer.encode(prompt, add_special_tokens=True)
    if isinstance(prompt, list) and prompt and _is_ids(prompt):
        return list(prompt)
    return None


def _is_ids(value: list) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)


VIEWS = {
    CHAT: chat_ids,
    COMPLETIONS: completion_ids,
    MESSAGES: messages_ids,
    RESPONSES: responses_ids,
}
