"""Responses and SSE chunks in the shapes OpenAI clients parse.

A completion request may carry several prompts ("parts", one engine request each); choice
``index`` is ``part * n + completion``, as OpenAI numbers them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prefixcache.server.tool_parse import ToolStream, content_of, cut_short, new_call_id, scan

if TYPE_CHECKING:  # annotations only: the preparation processes import this without torch
    from prefixcache.engine.logprobs import Logprob
    from prefixcache.engine.request import CompletionOutput, RequestOutput
    from prefixcache.engine.tokenizer import Tokenizer

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(slots=True)
class Shape:
    """What a response looks like: endpoint, model name, and what the request asked for."""

    request_id: str
    model: str
    chat: bool
    n: int
    tokenizer: Tokenizer
    logprobs: bool = False  # generated tokens' logprobs
    echo: list[str] | None = None  # completions: each part's prompt text, shown first
    tool_names: frozenset[str] | None = None  # chat with tools: calls are parsed out
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def prompt_field(self) -> str:
        return "messages" if self.chat else "prompt"

    @property
    def endpoint(self) -> str:
        return "chat" if self.chat else "completions"

    def respond(self, parts: Sequence[RequestOutput]) -> dict:
        return response(self, parts)

    def stream_formatter(self, num_parts: int) -> StreamFormatter:
        return StreamFormatter(self, num_parts)


def usage(parts: Sequence[RequestOutput]) -> dict:
    """Token counts over every part, with the cached share of the prompts."""
    completion = sum(len(o.token_ids) for part in parts for o in part.outputs)
    prompt = sum(len(part.prompt_token_ids) for part in parts)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(p.num_cached_tokens for p in parts)},
    }


def _finish(reason) -> str | None:
    return None if reason is None else str(reason)


def response(shape: Shape, parts: Sequence[RequestOutput]) -> dict:
    """The whole (non-streamed) response of a finished request."""
    choices = []
    for p, part in enumerate(parts):
        writer = _ChoiceWriter(shape, p, part)
        for o in part.outputs:
            choices.append(writer.full(o))
    return {
        "id": shape.request_id,
        "object": shape.object,
        "created": shape.created,
        "model": shape.model,
        "choices": choices,
        "usage": usage(parts),
    }


class _ChoiceWriter:
    """One part's choices: text, finish reason and logprobs in the endpoint's format."""

    def __init__(self, shape: Shape, part: int, output: RequestOutput) -> None:
        self.shape, self.part, self.output = shape, part, output

    def index(self, o: CompletionOutput) -> int:
        return self.part * self.shape.n + o.index

    def full(self, o: CompletionOutput) -> dict:
        if self.shape.chat:
            message, finish = self.message(o)
            return {
                "index": self.index(o),
                "message": message,
                "finish_reason": finish,
                "logprobs": self.chat_logprobs(o.logprobs),
            }
        echo = self.echo_text()
        logprobs = self.completion_logprobs(o.logprobs or [], 0, echo=True)
        return {
            "index": self.index(o),
            "text": echo + o.text,
            "finish_reason": _finish(o.finish_reason),
            "logprobs": logprobs,
        }

    def message(self, o: CompletionOutput) -> tuple[dict, str | None]:
        """The assistant message (its tool calls parsed out) and the finish reason."""
        if self.shape.tool_names is None:
            return {"role": "assistant", "content": o.text}, _finish(o.finish_reason)
        found = scan(o.text, self.shape.tool_names, final=True, cut=cut_short(o.finish_reason))
        message: dict = {"role": "assistant", "content": content_of(found)}
        if not found.complete_calls:
            return message, _finish(o.finish_reason)
        message["tool_calls"] = [
            {
                "id": new_call_id(),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in found.complete_calls
        ]
        return message, found.finish_reason(_finish(o.finish_reason))

    def echo_text(self) -> str:
        return "" if self.shape.echo is None else self.shape.echo[self.part]

    def chat_logprobs(self, entries: list[Logprob] | None) -> dict | None:
        if not self.shape.logprobs or entries is None:
            return None
        return {"content": [self._chat_entry(e) for e in entries], "refusal": None}

    def _chat_entry(self, entry: Logprob) -> dict:
        tokenizer = self.shape.tokenizer
        top = [
            {
                "token": tokenizer.token_text(t),
                "logprob": lp,
                "bytes": list(tokenizer.token_bytes(t)),
            }
            for t, lp in entry.top
        ]
        return {
            "token": tokenizer.token_text(entry.token_id),
            "logprob": entry.logprob,
            "bytes": list(tokenizer.token_bytes(entry.token_id)),
            "top_logprobs": top,
        }

    def completion_logprobs(self, entries: list[Logprob], offset: int, echo: bool) -> dict | None:
        """Legacy completions logprobs; with ``echo`` the prompt's come first."""
        prompt = self.output.prompt_logprobs if echo and self.shape.echo is not None else None
        if not self.shape.logprobs and prompt is None:
            return None
        logprobs: dict[str, list] = {
            "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []
        }  # fmt: skip
        if prompt is not None:
            for token, entry in zip(self.output.prompt_token_ids, prompt, strict=True):
                offset = self._add(logprobs, token, entry, offset)
        if self.shape.logprobs:
            for entry in entries:
                offset = self._add(logprobs, entry.token_id, entry, offset)
        return logprobs

    def _add(self, logprobs: dict, token: int, entry: Logprob | None, offset: int) -> int:
        """Append one token; the text offset after it."""
        text = self.shape.tokenizer.token_text(token)
        logprobs["tokens"].append(text)
        logprobs["token_logprobs"].append(None if entry is None else entry.logprob)
        logprobs["top_logprobs"].append(None if entry is None else self._top(entry, text))
        logprobs["text_offset"].append(offset)
        return offset + len(text)

    def _top(self, entry: Logprob, text: str) -> dict[str, float]:
        """The top tokens by text, and the chosen one (as vLLM does, so k=0 is not empty)."""
        top = {self.shape.tokenizer.token_text(t): lp for t, lp in entry.top}
        top.setdefault(text, entry.logprob)
        return top


class StreamFormatter:
    """Turns successive snapshots of a request's parts into OpenAI SSE chunks (deltas)."""

    def __init__(self, shape: Shape, num_parts: int = 1) -> None:
        self.shape = shape
        count = num_parts * shape.n
        self.sent_text = [0] * count
        self.sent_tokens = [0] * count
        self.sent_offset = [0] * count
        self.sent_finish = [False] * count
        self.started = [False] * count
        names = shape.tool_names
        self.tools = None if names is None else [ToolStream(names) for _ in range(count)]

    def first_chunks(self) -> list[str]:
        """Chat streams open with the assistant role, one chunk per choice."""
        if not self.shape.chat:
            return []
        return [
            self._event(
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "finish_reason": None,
                        "logprobs": None,
                    }
                ]
            )
            for i in range(len(self.sent_text))
        ]

    def chunks(self, output: RequestOutput, part: int = 0) -> list[str]:
        """One chunk per choice that has new text or tokens, or has just finished."""
        writer = _ChoiceWriter(self.shape, part, output)
        events = []
        for o in output.outputs:
            if self.tools is not None:
                events.extend(self._event([c]) for c in self._tool_choices(writer, o))
                continue
            choice = self._choice(writer, o)
            if choice is not None:
                events.append(self._event([choice]))
        return events

    def _tool_choices(self, writer: _ChoiceWriter, o: CompletionOutput) -> list[dict]:
        """A choice with tools: one chunk per content delta, call opened, arguments delta."""
        i = writer.index(o)
        stream = self.tools[i]
        finished = o.finish_reason is not None and not self.sent_finish[i]
        cut = finished and cut_short(o.finish_reason)
        deltas = [_tool_delta(event) for event in stream.update(o.text, finished, cut)]
        entries = (o.logprobs or [])[self.sent_tokens[i] :] if self.shape.logprobs else []
        if finished:
            reason = stream.last.finish_reason(_finish(o.finish_reason))
        if not deltas and (entries or finished):
            deltas = [{}]
        self.sent_tokens[i] += len(entries)
        self.sent_finish[i] |= finished
        choices = [
            {"index": i, "delta": d, "finish_reason": None, "logprobs": None} for d in deltas
        ]
        if choices and entries:
            choices[0]["logprobs"] = writer.chat_logprobs(entries)
        if finished:
            choices[-1]["finish_reason"] = reason
        return choices

    def last_chunks(self, parts: Sequence[RequestOutput], include_usage: bool) -> list[str]:
        """The end of the stream: the usage chunk if asked for, then [DONE]."""
        return [self.usage_chunk(parts), DONE] if include_usage else [DONE]

    def _choice(self, writer: _ChoiceWriter, o: CompletionOutput) -> dict | None:
        i = writer.index(o)
        delta = o.text[self.sent_text[i] :]
        entries = (o.logprobs or [])[self.sent_tokens[i] :] if self.shape.logprobs else []
        finished = o.finish_reason is not None and not self.sent_finish[i]
        opening = not self.started[i] and not self.shape.chat and self.shape.echo is not None
        if not (delta or entries or finished or opening):
            return None
        self.sent_text[i] = len(o.text)
        self.sent_tokens[i] += len(entries)
        self.sent_finish[i] |= finished
        self.started[i] = True
        choice: dict = {"index": i, "finish_reason": _finish(o.finish_reason) if finished else None}
        if self.shape.chat:
            choice["delta"] = {"content": delta} if delta else {}
            choice["logprobs"] = writer.chat_logprobs(entries) if entries else None
            return choice
        echo = writer.echo_text() if opening else ""
        logprobs = writer.completion_logprobs(entries, self.sent_offset[i], echo=opening)
        if logprobs is not None and logprobs["text_offset"]:
            last = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
            self.sent_offset[i] = last
        choice["text"] = echo + delta
        choice["logprobs"] = logprobs
        return choice

    def usage_chunk(self, parts: Sequence[RequestOutput]) -> str:
        return self._event([], usage=usage(parts))

    def _event(self, choices: list[dict], **extra: object) -> str:
        body = {
            "id": self.shape.request_id,
            "object": f"{self.shape.object}.chunk" if self.shape.chat else self.shape.object,
            "created": self.shape.created,
            "model": self.shape.model,
            "choices": choices,
            **extra,
        }
        return f"data: {json.dumps(body)}\n\n"


def _tool_delta(event: tuple) -> dict:
    """A ToolStream event as OpenAI's chat delta."""
    if event[0] == "text":
        return {"content": event[1]}
    if event[0] == "call":
        _, index, call_id, name = event
        function = {"name": name, "arguments": ""}
        return {
            "tool_calls": [
                {"index": index, "id": call_id, "type": "function", "function": function}
            ]
        }
    return {"tool_calls": [{"index": event[1], "function": {"arguments": event[2]}}]}


DONE = "data: [DONE]\n\n"
