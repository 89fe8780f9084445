"""Responses and SSE events of ``POST /v1/messages`` in the shapes Anthropic's clients parse.

Usage splits the prompt three ways (they sum to its length): ``cache_read_input_tokens``
came from the cache (pool and tier); ``cache_creation_input_tokens`` are the tokens past
those, up to the last breakpoint (to the last full block), that this request computed and
retained, split by the ttl of the breakpoint covering them; ``input_tokens`` are the rest.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from prefixcache.cache.retention import Keep
from prefixcache.engine.request import FinishReason, RequestOutput
from prefixcache.engine.tokenizer import Tokenizer
from prefixcache.protocol.cache_controls import ANTHROPIC_TTLS
from prefixcache.server.fan_in import FanIn


@dataclass(slots=True)
class MessageShape:
    """What a Messages response needs to know of its request."""

    request_id: str
    model: str
    tokenizer: Tokenizer
    stop_sequences: list[str]
    keeps: tuple[Keep, ...]
    block_size: int
    chat: bool = True  # a conversation: engine refusals name "messages"
    endpoint: str = "messages"  # the metrics label


def usage(shape: MessageShape, output: RequestOutput) -> dict:
    """Prompt tokens read, created (by ttl) and neither; generated tokens."""
    read = output.num_cached_tokens
    created = dict.fromkeys(ANTHROPIC_TTLS, 0)
    covered = read
    retained = output.retained_blocks or (0,) * len(shape.keeps)
    for keep, blocks in sorted(zip(shape.keeps, retained, strict=True), key=lambda k: k[0][0]):
        end = min(blocks * shape.block_size, keep.num_tokens)
        if end > covered:
            created[keep.retention_class] += end - covered
            covered = end
    creation = sum(created.values())
    return {
        "input_tokens": len(output.prompt_token_ids) - read - creation,
        "cache_creation_input_tokens": creation,
        "cache_read_input_tokens": read,
        "cache_creation": {f"ephemeral_{ttl}_input_tokens": created[ttl] for ttl in ANTHROPIC_TTLS},
        "output_tokens": len(output.outputs[0].token_ids),
    }


def stop(shape: MessageShape, output: RequestOutput) -> tuple[str | None, str | None]:
    """``stop_reason`` and ``stop_sequence`` of a finished completion."""
    completion = output.outputs[0]
    if completion.finish_reason is None:
        return None, None
    if completion.finish_reason == FinishReason.LENGTH:
        return "max_tokens", None
    ids = completion.token_ids
    if not shape.stop_sequences or (ids and ids[-1] in shape.tokenizer.eos_token_ids):
        return "end_turn", None
    rest = shape.tokenizer.decode(ids)[len(completion.text) :]
    found = next((s for s in shape.stop_sequences if rest.startswith(s)), None)
    found = found or next((s for s in shape.stop_sequences if s in rest), None)
    return ("stop_sequence", found) if found else ("end_turn", None)


def message(shape: MessageShape, output: RequestOutput, opening: bool = False) -> dict:
    """The message object: whole, or as it opens a stream (no content, no stop, usage of
    the prompt only)."""
    reason, sequence = (None, None) if opening else stop(shape, output)
    counts = usage(shape, output)
    content = [] if opening else [{"type": "text", "text": output.outputs[0].text}]
    if opening:
        counts["output_tokens"] = 0
    return {
        "id": shape.request_id,
        "type": "message",
        "role": "assistant",
        "model": shape.model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": counts,
    }


def response(shape: MessageShape, finals: Sequence[RequestOutput]) -> dict:
    """The whole (non-streamed) response of a finished request."""
    return message(shape, finals[0])


def event(name: str, data: dict) -> str:
    """One SSE event as Anthropic sends it: an ``event:`` line, then its ``data:``."""
    return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n"


def error_event(message_text: str) -> str:
    return event("error", {"error": {"type": "api_error", "message": message_text}})


async def events(
    shape: MessageShape, fan_in: FanIn, done: Callable[[list[RequestOutput], str], None]
) -> AsyncIterator[str]:
    """message_start (once the prompt is in: its usage is known), the text block's start,
    a ping, its deltas and stop, message_delta (stop reason, usage), message_stop."""
    status = "disconnected"
    try:
        output = await _first_token(fan_in)
        yield event("message_start", {"message": message(shape, output, opening=True)})
        block = {"type": "text", "text": ""}
        yield event("content_block_start", {"index": 0, "content_block": block})
        yield event("ping", {})
        sent = 0
        while True:
            text = output.outputs[0].text
            if len(text) > sent:
                delta = {"type": "text_delta", "text": text[sent:]}
                yield event("content_block_delta", {"index": 0, "delta": delta})
                sent = len(text)
            if fan_in.finished:
                break
            _, output = await fan_in.next()
        yield event("content_block_stop", {"index": 0})
        reason, sequence = stop(shape, output)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        yield event("message_delta", {"delta": delta, "usage": usage(shape, output)})
        status = "ok"
        yield event("message_stop", {})
    except RuntimeError as error:  # the engine step failed: tell the client, end cleanly
        status = "engine_error"
        yield error_event(str(error))
    finally:
        fan_in.close()
        done(fan_in.finals(), status)


async def _first_token(fan_in: FanIn) -> RequestOutput:
    """The first snapshot with a generated token (its prompt is committed and retained)."""
    while True:
        _, output = await fan_in.next()
        if output.outputs[0].token_ids or output.finished:
            return output
