"""Completion text read as content and tool calls (the generic ``<tool_call>`` format).

``scan`` reads a whole text, or a prefix of one while it streams: content is released
only where it cannot be the start of a call tag (as stop strings are held back), and a
call being written shows its name once the name is complete and its arguments as far as
they go. A call tag whose JSON is not a well-formed call of a known tool stays content.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

from prefixcache.engine.stop_holdback import releasable_length
from prefixcache.protocol.constraints import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
_TAIL = re.compile(r"\s*\}\s*")
_DECODER = json.JSONDecoder()


def new_call_id(prefix: str = "call") -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # the arguments object's text, as written; a prefix while incomplete
    complete: bool = True


@dataclass(slots=True)
class Scan:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)

    @property
    def complete_calls(self) -> list[ParsedCall]:
        return [c for c in self.calls if c.complete]

    def finish_reason(self, reason: str | None) -> str | None:
        """``"tool_calls"`` once the text made complete calls and none was cut short (even
        if ``max_tokens`` ended it just after them); otherwise the engine's ``reason``."""
        return "tool_calls" if reason is not None and self.made_calls else reason

    @property
    def made_calls(self) -> bool:
        """Complete calls, and none cut short after them."""
        return bool(self.complete_calls) and all(c.complete for c in self.calls)


def scan(text: str, names: frozenset[str], final: bool, cut: bool = False) -> Scan:
    """Content and calls of ``text``; ``final=False``: a prefix, more may follow.

    ``cut``: the text is final but was cut short (by ``max_tokens``): a call tag it left
    open, and a tag it was opening, are not content (a call whose name was complete is a
    partial call).
    """
    content: list[str] = []
    calls: list[ParsedCall] = []
    pos = 0
    while True:
        start = text.find(TOOL_CALL_OPEN, pos)
        if start < 0:
            tail = text[pos:]
            whole = final and not cut
            content.append(tail if whole else tail[: releasable_length(tail, [TOOL_CALL_OPEN])])
            break
        content.append(text[pos:start])
        body = start + len(TOOL_CALL_OPEN)
        end = text.find(TOOL_CALL_CLOSE, body)
        if end < 0:
            partial = _partial_call(text[body:], names) if cut or not final else None
            calls.extend([partial] if partial else [])
            if final and not cut:
                content.append(text[start:])  # never closed: text after all
            break
        call = _complete_call(text[body:end], names)
        if call is None:
            content.append(text[start : end + len(TOOL_CALL_CLOSE)])
        else:
            calls.append(call)
        pos = end + len(TOOL_CALL_CLOSE)
    return Scan("".join(content), calls)


def _name(head: re.Match, names: frozenset[str]) -> str | None:
    try:
        name = json.loads(head.group(1))
    except ValueError:
        return None
    return name if name in names else None


def _complete_call(body: str, names: frozenset[str]) -> ParsedCall | None:
    """A call's JSON, name first (arguments kept as written) or in any order (re-written)."""
    head = _HEAD.match(body)
    if head and (name := _name(head, names)):
        try:
            value, end = _DECODER.raw_decode(body, head.end())
        except ValueError:
            value, end = None, 0
        if isinstance(value, dict) and _TAIL.fullmatch(body, end):
            return ParsedCall(name, body[head.end() : end])
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if (
        isinstance(call, dict)
        and set(call) == {"name", "arguments"}
        and call["name"] in names
        and isinstance(call["arguments"], dict)
    ):
        return ParsedCall(call["name"], json.dumps(call["arguments"], ensure_ascii=False))
    return None


def _partial_call(body: str, names: frozenset[str]) -> ParsedCall | None:
    """A call still being written: its name once complete, its arguments so far."""
    head = _HEAD.match(body)
    name = _name(head, names) if head else None
    if name is None:
        return None
    arguments = body[head.end() :]
    return ParsedCall(name, arguments[: _object_extent(arguments)], complete=False)


def _object_extent(text: str) -> int:
    """How much of ``text`` belongs to the JSON object it starts with (all of it while open)."""
    if not text.startswith("{"):
        return 0
    depth, in_string, escaped = 0, False, False
    for i, char in enumerate(text):
        if in_string:
            escaped = not escaped and char == "\\"
            in_string = escaped or char != '"'
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


@dataclass(slots=True)
class ToolStream:
    """What a streamed choice has shown: content so far, and each call's id and arguments."""

    names: frozenset[str]
    sent_content: int = 0
    ids: list[str] = field(default_factory=list)
    sent_arguments: list[int] = field(default_factory=list)
    id_prefix: str = "call"  # Anthropic's are "toolu"
    last: Scan = field(default_factory=lambda: Scan(""))  # the latest scan of the text

    def update(self, text: str, final: bool, cut: bool = False) -> list[tuple]:
        """New events: ("text", delta), ("call", index, id, name), ("arguments", index, delta).

        Content that is only whitespace waits (before calls it is dropped, as in the
        non-streamed answer); an announced call is never taken back (``cut``: as ``scan``;
        ``self.last`` then says whether a call was cut short).
        """
        found = self.last = scan(text, self.names, final, cut)
        events: list[tuple] = []
        if found.content.strip() or (final and not found.calls and not self.ids):
            delta = found.content[self.sent_content :]
            if delta:
                events.append(("text", delta))
                self.sent_content = len(found.content)
        for index, call in enumerate(found.calls):
            if index == len(self.ids):
                self.ids.append(new_call_id(self.id_prefix))
                self.sent_arguments.append(0)
                events.append(("call", index, self.ids[index], call.name))
            delta = call.arguments[self.sent_arguments[index] :]
            if delta:
                events.append(("arguments", index, delta))
                self.sent_arguments[index] = len(call.arguments)
        return events


def content_of(found: Scan) -> str | None:
    """The message content: the text, or None when it is only spaces beside calls."""
    if found.complete_calls and not found.content.strip():
        return None
    return found.content


def cut_short(finish_reason: object) -> bool:
    """Whether ``max_tokens`` ended a completion (so a call it was writing is cut short)."""
    return finish_reason is not None and str(finish_reason) == "length"
