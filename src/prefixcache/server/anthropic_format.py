"""Responses and SSE events of ``POST /v1/messages`` in the shapes Anthropic's clients parse.

Usage splits the prompt three ways (they sum to its length): ``cache_read_input_tokens``
came from the cache (pool and tier); ``cache_creation_input_tokens`` are the tokens past
those, up to the last breakpoint (to the last full block), that this request computed and
retained, split by the ttl of the breakpoint covering them; ``input_tokens`` are the rest.

With tools, calls are parsed out of the text (``server/tool_parse.py``) into ``tool_use``
blocks after any text block, and streamed as their own blocks (``input_json_delta``
fragments of the input); the ``<tool_call>`` tags themselves are never sent.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from prefixcache.cache.retention import Keep
from prefixcache.engine.request import CompletionOutput, FinishReason, RequestOutput
from prefixcache.engine.tokenizer import Tokenizer
from prefixcache.protocol.cache_controls import ANTHROPIC_TTLS
from prefixcache.protocol.errors import MESSAGES_PATH
from prefixcache.server.fan_in import FanIn, failure_event
from prefixcache.server.tool_parse import ToolStream, content_of, cut_short, new_call_id, scan

CALL_ID_PREFIX = "toolu"


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
    tool_names: frozenset[str] | None = None  # with tools: calls are parsed out


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


def content_blocks(shape: MessageShape, completion: CompletionOutput) -> tuple[list[dict], bool]:
    """The text block (unless only spaces beside calls), then a tool_use block per complete
    call; and whether the calls stand (none was cut short by ``max_tokens``)."""
    text = completion.text
    if shape.tool_names is None:
        return [{"type": "text", "text": text}], False
    found = scan(text, shape.tool_names, final=True, cut=cut_short(completion.finish_reason))
    content = content_of(found)
    blocks = [] if content is None else [{"type": "text", "text": content}]
    return blocks + [
        {
            "type": "tool_use",
            "id": new_call_id(CALL_ID_PREFIX),
            "name": call.name,
            "input": json.loads(call.arguments),
        }
        for call in found.complete_calls
    ], found.made_calls


def message(shape: MessageShape, output: RequestOutput, opening: bool = False) -> dict:
    """The message object: whole, or as it opens a stream (no content, no stop, usage of
    the prompt only)."""
    reason, sequence = (None, None) if opening else stop(shape, output)
    counts = usage(shape, output)
    content, called = ([], False) if opening else content_blocks(shape, output.outputs[0])
    if called:
        reason, sequence = "tool_use", None
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


@dataclass(slots=True)
class _Blocks:
    """The content blocks a stream has opened: the last one's index, and whether it is open."""

    index: int = -1
    kind: str | None = None  # the open block's type
    tools: ToolStream | None = None
    sent: int = 0  # characters of text sent (no tools)

    def start(self, block: dict) -> list[str]:
        events = self.stop()
        self.index, self.kind = self.index + 1, block["type"]
        return events + [
            event("content_block_start", {"index": self.index, "content_block": block})
        ]

    def stop(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [event("content_block_stop", {"index": self.index})]

    def delta(self, delta: dict) -> str:
        return event("content_block_delta", {"index": self.index, "delta": delta})

    def update(self, text: str, final: bool, cut: bool = False) -> list[str]:
        """The events for the text so far: text deltas, or with tools each block's (``cut``:
        ``max_tokens`` ended it)."""
        if self.tools is None:
            delta, self.sent = text[self.sent :], max(self.sent, len(text))
            return [self.delta({"type": "text_delta", "text": delta})] if delta else []
        events: list[str] = []
        for found in self.tools.update(text, final, cut):
            if found[0] == "text":
                events += [] if self.kind == "text" else self.start({"type": "text", "text": ""})
                events.append(self.delta({"type": "text_delta", "text": found[1]}))
            elif found[0] == "call":
                block = {"type": "tool_use", "id": found[2], "name": found[3], "input": {}}
                events += self.start(block)
            else:
                events.append(self.delta({"type": "input_json_delta", "partial_json": found[2]}))
        return events


async def events(
    shape: MessageShape, fan_in: FanIn, done: Callable[[list[RequestOutput], str], None]
) -> AsyncIterator[str]:
    """message_start (once the prompt is in: its usage is known), the text block's start,
    a ping, its deltas and stop (with tools: a block per text or call, opened as it comes),
    message_delta (stop reason, usage), message_stop."""
    status = "disconnected"
    try:
        output = await _first_token(fan_in)
        yield event("message_start", {"message": message(shape, output, opening=True)})
        blocks = _Blocks()
        if shape.tool_names is None:
            for line in blocks.start({"type": "text", "text": ""}):
                yield line
        else:
            blocks.tools = ToolStream(shape.tool_names, id_prefix=CALL_ID_PREFIX)
        yield event("ping", {})
        while True:
            completion = output.outputs[0]
            cut = fan_in.finished and cut_short(completion.finish_reason)
            for line in blocks.update(completion.text, fan_in.finished, cut):
                yield line
            if fan_in.finished:
                break
            _, output = await fan_in.next()
        for line in blocks.start({"type": "text", "text": ""}) if blocks.index < 0 else []:
            yield line
        for line in blocks.stop():
            yield line
        reason, sequence = stop(shape, output)
        if blocks.tools is not None and blocks.tools.last.made_calls:
            reason, sequence = "tool_use", None
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        yield event("message_delta", {"delta": delta, "usage": usage(shape, output)})
        status = "ok"
        yield event("message_stop", {})
    except RuntimeError as error:  # the engine step failed, or the shutdown deadline came
        status = "engine_error"
        yield failure_event(error, MESSAGES_PATH)
    finally:
        fan_in.close()
        done(fan_in.finals(), status)


async def _first_token(fan_in: FanIn) -> RequestOutput:
    """The first snapshot with a generated token (its prompt is committed and retained)."""
    while True:
        _, output = await fan_in.next()
        if output.outputs[0].token_ids or output.finished:
            return output
