"""Response objects and SSE events of the Responses API, from the engine's snapshots.

Output items are a ``message`` (one ``output_text`` part) for text and a ``function_call``
per call, in the order the model wrote them. A finished response is saved to the store
(unless ``store: false``) with its output as the conversation's last turn.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from prefixcache.engine.request import RequestOutput
from prefixcache.protocol.tool_prompt import Call, Turn
from prefixcache.server.response_store import Record
from prefixcache.server.tool_parse import ToolStream, content_of, cut_short, new_call_id, scan

Save = Callable[[str, Record], None]


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


@dataclass(slots=True)
class ResponsesShape:
    """What a response echoes of its request, and where it is saved."""

    request_id: str
    model: str
    turns: list[Turn]  # the conversation the prompt was rendered from
    echo: dict  # request fields a response repeats (instructions, tools, ...)
    tool_names: frozenset[str] | None = None
    save: Save | None = None  # None: store is false
    input_items: list[dict] = field(default_factory=list)  # ``input`` as items (stored)
    tokenizer: object = None
    created: int = field(default_factory=lambda: int(time.time()))
    chat: bool = False
    endpoint: str = "responses"
    prompt_field: str = "input"

    def respond(self, parts: Sequence[RequestOutput]) -> dict:
        """The whole response of a finished request (saved first)."""
        output = parts[0].outputs[0]
        cut = cut_short(output.finish_reason)
        found = scan(output.text, self.tool_names or frozenset(), final=True, cut=cut)
        items: list[dict] = []
        text = content_of(found) if self.tool_names else output.text
        if text is not None and (text or not found.complete_calls):
            items.append(message_item(new_id("msg"), text, "completed"))
        for call in found.complete_calls:
            items.append(call_item(new_id("fc"), new_call_id(), call.name, call.arguments))
        return self.finish(parts[0], items)

    def finish(self, part: RequestOutput, items: list[dict]) -> dict:
        """The response object with ``items`` as its output; saved unless store is false."""
        counts = (len(part.prompt_token_ids), len(part.outputs[0].token_ids))
        incomplete = part.outputs[0].finish_reason == "length"
        response = self.body(
            "incomplete" if incomplete else "completed",
            items,
            usage(part),
            {"reason": "max_output_tokens"} if incomplete else None,
        )
        if self.save is not None:
            turns = [*self.turns, output_turn(items)]
            self.save(self.request_id, Record(turns, counts, response, self.input_items))
        return response

    def body(
        self, status: str, items: list[dict], used: dict | None, incomplete: dict | None = None
    ) -> dict:
        return {
            "id": self.request_id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": items,
            "usage": used,
            "error": None,
            "incomplete_details": incomplete,
            "metadata": {},
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            **self.echo,
        }

    def stream_formatter(self, num_parts: int) -> ResponsesStream:
        return ResponsesStream(self)


def message_item(item_id: str, text: str, status: str) -> dict:
    part = {"type": "output_text", "text": text, "annotations": []}
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [part] if status == "completed" else [],
    }


def call_item(item_id: str, call_id: str, name: str, arguments: str, status="completed") -> dict:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def input_items(value: str | list) -> list[dict]:
    """A request's ``input`` (already checked by ``responses_api.input_turns``) as the items
    ``GET /v1/responses/{id}/input_items`` lists, each with an id."""
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    return [_input_item(item) for item in value]


def _input_item(item: dict) -> dict:
    kind = item.get("type", "message")
    if kind == "function_call":
        fields = {k: item[k] for k in ("call_id", "name", "arguments")}
        return {"type": kind, "id": new_id("fc"), **fields, "status": "completed"}
    if kind == "function_call_output":
        output = item["output"]
        if isinstance(output, list):
            output = "".join(part["text"] for part in output)
        fields = {"call_id": item["call_id"], "output": output}
        return {"type": kind, "id": new_id("fco"), **fields, "status": "completed"}
    role, content = item["role"], item["content"]
    texts = [content] if isinstance(content, str) else [part["text"] for part in content]
    part_type = "output_text" if role == "assistant" else "input_text"
    extra = {"annotations": []} if role == "assistant" else {}
    parts = [{"type": part_type, "text": text, **extra} for text in texts]
    return {"type": "message", "id": new_id("msg"), "role": role, "content": parts,
            "status": "completed"}  # fmt: skip


def output_turn(items: list[dict]) -> Turn:
    """A response's output as the assistant turn a later request continues from."""
    text = "".join(
        part["text"] for item in items if item["type"] == "message" for part in item["content"]
    )
    calls = [
        Call(item["call_id"], item["name"], item["arguments"])
        for item in items
        if item["type"] == "function_call"
    ]
    return Turn("assistant", text, calls)


def usage(part: RequestOutput) -> dict:
    prompt, completion = len(part.prompt_token_ids), len(part.outputs[0].token_ids)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": part.num_cached_tokens},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


class ResponsesStream:
    """Snapshots of one request as Responses SSE events, each with its sequence number."""

    def __init__(self, shape: ResponsesShape) -> None:
        self.shape = shape
        self.tools = ToolStream(shape.tool_names or frozenset())
        self.sequence = 0
        self.items: list[dict] = []
        self.open: dict | None = None  # the item being written
        self.finished = False

    def first_chunks(self) -> list[str]:
        response = self.shape.body("in_progress", [], None)
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
        ]

    def chunks(self, output: RequestOutput, part: int = 0) -> list[str]:
        completion = output.outputs[0]
        final = completion.finish_reason is not None and not self.finished
        if self.finished:
            return []
        self.finished = final
        if self.shape.tool_names is None:
            sent = self.tools.sent_content
            self.tools.sent_content = len(completion.text)
            delta = completion.text[sent:]
            events = [("text", delta)] if delta else []
        else:
            cut = final and cut_short(completion.finish_reason)
            events = self.tools.update(completion.text, final, cut)
        out = [e for event in events for e in self._on(event)]
        if final:
            if not self.items and self.open is None:  # no text at all: an empty message
                out += self._open_message()
            out += self._close()
        return out

    def last_chunks(self, parts: Sequence[RequestOutput], include_usage: bool) -> list[str]:
        response = self.shape.finish(parts[0], self.items)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return [self._event(kind, response=response)]

    def _on(self, event: tuple) -> list[str]:
        if event[0] == "text":
            out = [] if self.open and self.open["type"] == "message" else self._open_message()
            self.open["content"][0]["text"] += event[1]
            return out + [self._text_event("response.output_text.delta", delta=event[1])]
        if event[0] == "call":
            _, _index, call_id, name = event
            item = call_item(new_id("fc"), call_id, name, "", "in_progress")
            return self._close() + self._add(item)
        self.open["arguments"] += event[2]
        return [
            self._event(
                "response.function_call_arguments.delta",
                item_id=self.open["id"],
                output_index=len(self.items),
                delta=event[2],
            )
        ]

    def _open_message(self) -> list[str]:
        item = message_item(new_id("msg"), "", "in_progress")
        out = self._close() + self._add(item)
        part = {"type": "output_text", "text": "", "annotations": []}
        item["content"] = [dict(part)]
        out.append(self._text_event("response.content_part.added", part=part))
        return out

    def _add(self, item: dict) -> list[str]:
        self.open = item
        shown = {**item, "content": []} if item["type"] == "message" else dict(item)
        return [self._event("response.output_item.added", output_index=len(self.items), item=shown)]

    def _close(self) -> list[str]:
        """Events that end the open item; it joins the output."""
        item, self.open = self.open, None
        if item is None:
            return []
        index = len(self.items)
        item["status"] = "completed"
        self.items.append(item)
        if item["type"] == "message":
            part = item["content"][0]
            out = [
                self._text_event("response.output_text.done", index, text=part["text"]),
                self._text_event("response.content_part.done", index, part=part),
            ]
        else:
            out = [
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    arguments=item["arguments"],
                )
            ]
        return out + [self._event("response.output_item.done", output_index=index, item=item)]

    def _text_event(self, kind: str, index: int | None = None, **fields: object) -> str:
        item = self.open if index is None else self.items[index]
        where = len(self.items) if index is None else index
        return self._event(kind, item_id=item["id"], output_index=where, content_index=0, **fields)

    def _event(self, kind: str, **fields: object) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n"
