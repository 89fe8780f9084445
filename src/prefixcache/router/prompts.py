"""What routing needs from a request body: stream or not, the client salt, the prompt's
``prompt_cache_key`` (key affinity), the prompt's token ids.

The replica is the authority on what it accepts: the router refuses only a body the
replica's strict JSON parser refuses (``protocol/json_body.load_json``: the same 400s,
the same messages) and forwards anything else, so a bad field or an unknown model gets the
replica's own error. It runs on a worker thread, never on the router's event loop. When it
can, it tokenizes the prompt exactly as the replica will (``server/prepare.py``):
``encode_chat`` of the messages' text for chat, ``encode(prompt, add_special_tokens=True)``
or the ids as sent for text completions (the first prompt of a batch: the whole request
goes to one replica).
"""

from __future__ import annotations

from typing import NamedTuple

from pydantic import ValidationError

from prefixcache.engine.tokenizer import Tokenizer
from prefixcache.protocol.json_body import load_json
from prefixcache.protocol.schemas import ChatMessage


class RoutingView(NamedTuple):
    """The parts of a body routing reads; ``token_ids`` None when unknown or not needed."""

    stream: bool
    cache_salt: str | None
    token_ids: list[int] | None
    cache_key: str | None = None  # ``prompt_cache_key``: never logged (routes digest it)


def routing_view(raw: bytes, chat: bool, tokenizer: Tokenizer | None) -> RoutingView:
    """Stream flag, client salt and (given a tokenizer) the prompt's ids, as a replica reads;
    ApiError(400) where the replica's parser would refuse the body."""
    data = load_json(raw)
    salt = data.get("cache_salt")
    stream = data.get("stream") is True
    salt = salt if isinstance(salt, str) else None
    key = data.get("prompt_cache_key")
    key = key if isinstance(key, str) and key else None
    if tokenizer is None:
        return RoutingView(stream, salt, None, key)
    ids = chat_ids(data, tokenizer) if chat else completion_ids(data, tokenizer)
    return RoutingView(stream, salt, ids, key)


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
