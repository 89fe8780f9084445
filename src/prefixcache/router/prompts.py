"""What routing needs from a request body: stream or not, the client salt, the prompt's token ids.

The replica is the authority on what it accepts: the router rejects only a body that is
not JSON (400, the replica's message) and forwards anything else, so a bad field or an
unknown model gets the replica's own error. When it can, it tokenizes the prompt exactly
as the replica will (``server/app.py``): ``encode_chat`` of the messages' text for chat,
``encode(prompt, add_special_tokens=True)`` or the ids as sent for text completions (the
first prompt of a batch: the whole request goes to one replica).
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from pydantic import ValidationError

from prefixcache.engine.tokenizer import Tokenizer
from prefixcache.protocol.errors import ApiError
from prefixcache.protocol.schemas import ChatMessage


class RoutingView(NamedTuple):
    """The parts of a body routing reads; ``token_ids`` None when unknown or not needed."""

    stream: bool
    cache_salt: str | None
    token_ids: list[int] | None


def read_body(raw: bytes) -> Any:
    """The JSON body; 400 (an OpenAI error) if it is not JSON."""
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ApiError(400, f"request body is not valid JSON: {error}") from None


def routing_view(raw: bytes, chat: bool, tokenizer: Tokenizer | None) -> RoutingView:
    """Stream flag, client salt and (given a tokenizer) the prompt's ids, as a replica reads."""
    data = read_body(raw)
    if not isinstance(data, dict):
        return RoutingView(False, None, None)  # the replica answers with its own 400
    salt = data.get("cache_salt")
    stream = data.get("stream") is True
    salt = salt if isinstance(salt, str) else None
    if tokenizer is None:
        return RoutingView(stream, salt, None)
    ids = chat_ids(data, tokenizer) if chat else completion_ids(data, tokenizer)
    return RoutingView(stream, salt, ids)


def chat_ids(data: dict, tokenizer: Tokenizer) -> list[int] | None:
    """The chat template over the messages' text; None if the replica would refuse them."""
    try:
        messages = [ChatMessage.model_validate(m) for m in data.get("messages") or []]
        if not messages:
            return None
        return tokenizer.encode_chat([{"role": m.role, "content": m.text()} for m in messages])
    except (ValidationError, ValueError, TypeError):
        return None


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
