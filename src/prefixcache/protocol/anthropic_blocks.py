"""A Messages API body as the conversation every API shares, and its cache breakpoints.

Text blocks are a turn's content; an assistant's ``tool_use`` blocks are its calls; each
user ``tool_result`` block is a tool turn answering an earlier call (``protocol/turns.py``),
so the conversation renders exactly as the same one through chat completions. Every error
is a 400 naming the block's field (``messages.2.content.1.cache_control.ttl``). A
breakpoint is a ``cache_control`` on a tool, a block, or the request's own (its last
block): the prompt through the end of that is to stay cached for its ttl.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from prefixcache.protocol.anthropic_schemas import MessagesRequest
from prefixcache.protocol.cache_controls import (
    ANTHROPIC_DEFAULT_TTL,
    ANTHROPIC_TTLS,
    MAX_ANTHROPIC_BREAKPOINTS,
)
from prefixcache.protocol.errors import ApiError
from prefixcache.protocol.tool_schemas import MAX_TOOL_NAME, TOOL_NAME
from prefixcache.protocol.turns import Call, Turn

NOT_YET = ("image", "document", "thinking", "redacted_thinking")
TOOLS = -1  # a breakpoint's turn: the end of the tools block
MAX_ID_CHARS = 256
ERROR_PREFIX = "Error: "  # before a tool_result's content when its is_error is true


@dataclass(frozen=True, slots=True)
class Breakpoint:
    """The end of a marked block: turn index (or TOOLS), characters of that turn's
    content, ttl."""

    turn: int
    chars: int
    ttl: str
    path: str  # the field that asked for it


def conversation(body: MessagesRequest) -> tuple[list[Turn], list[Breakpoint]]:
    """The turns (system first, if any) and the breakpoints in prompt order, checked."""
    turns: list[Turn] = []
    marks: list[Breakpoint] = []
    for i, tool in enumerate(body.tools):  # tools come first: they render in the system block
        if tool.cache_control is not None:
            where = f"tools.{i}.cache_control"
            marks.append(Breakpoint(TOOLS, 0, cache_ttl(tool.cache_control, where), where))
    if body.system is not None:
        _add_system(turns, marks, body.system)
    calls: set[str] = set()
    for i, message in enumerate(body.messages):
        path = f"messages.{i}.content"
        if message.role == "assistant":
            _add_assistant(turns, marks, message.content, path, calls)
        else:
            _add_user(turns, marks, message.content, path, calls)
    if body.cache_control is not None:
        ttl = cache_ttl(body.cache_control, "cache_control")
        last = len(turns) - 1
        marks.append(Breakpoint(last, len(turns[last].content), ttl, "cache_control"))
    check_breakpoints(marks)
    return turns, marks


def _blocks(content: Any, path: str) -> list:
    """A content as blocks (a string is one text block); 400 for anything else."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        what = "a string or a list of content blocks"
        raise ApiError(400, f"{path}: must be {what}, got {type(content).__name__}", path)
    return content


def _mark(block: dict, where: str, turns: list[Turn], marks: list[Breakpoint]) -> None:
    """The block's breakpoint, if any, at the end of the last turn's content so far."""
    control = block.get("cache_control")
    if control is not None:
        ttl = cache_ttl(control, f"{where}.cache_control")
        at = len(turns[-1].content)
        marks.append(Breakpoint(len(turns) - 1, at, ttl, f"{where}.cache_control"))


def _add_system(turns: list[Turn], marks: list[Breakpoint], content: Any) -> None:
    turns.append(Turn("system"))
    for j, block in enumerate(_blocks(content, "system")):
        where = f"system.{j}"
        turns[-1].content += block_text(block, where, system=True)
        _mark(block, where, turns, marks)


def _add_assistant(
    turns: list[Turn], marks: list[Breakpoint], content: Any, path: str, calls: set[str]
) -> None:
    """One assistant turn: its text blocks, then its calls."""
    turns.append(Turn("assistant"))
    for j, block in enumerate(_blocks(content, path)):
        where = f"{path}.{j}"
        if _kind(block, where) == "tool_use":
            call = tool_use(block, where)
            turns[-1].calls.append(call)
            calls.add(call.id)
        else:
            turns[-1].content += block_text(block, where, system=False)
        _mark(block, where, turns, marks)


def _add_user(
    turns: list[Turn], marks: list[Breakpoint], content: Any, path: str, calls: set[str]
) -> None:
    """User turns of text, and a tool turn for each tool_result block."""
    blocks = _blocks(content, path)
    if not blocks:
        turns.append(Turn("user"))
    for j, block in enumerate(blocks):
        where = f"{path}.{j}"
        if _kind(block, where) == "tool_result":
            turns.append(tool_result(block, where, calls))
        else:
            text = block_text(block, where, system=False)
            if j == 0 or turns[-1].role != "user":
                turns.append(Turn("user"))
            turns[-1].content += text
        _mark(block, where, turns, marks)


def _kind(block: Any, path: str) -> Any:
    if not isinstance(block, dict):
        raise ApiError(400, f"{path}: must be a content block object", path)
    return block.get("type")


def tool_use(block: dict, path: str) -> Call:
    """An assistant's ``tool_use`` block as its call (the input as JSON text)."""
    call_id = block.get("id")
    if not isinstance(call_id, str) or not 0 < len(call_id) <= MAX_ID_CHARS:
        message = f"{path}.id: must be a string of 1 to {MAX_ID_CHARS} characters"
        raise ApiError(400, message, f"{path}.id")
    name = block.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        message = f"{path}.name: must be 1 to {MAX_TOOL_NAME} letters, digits, '_' or '-'"
        raise ApiError(400, message, f"{path}.name")
    arguments = block.get("input")
    if not isinstance(arguments, dict):
        raise ApiError(400, f"{path}.input: must be an object", f"{path}.input")
    return Call(call_id, name, json.dumps(arguments, ensure_ascii=False))


def tool_result(block: dict, path: str, calls: set[str]) -> Turn:
    """A user's ``tool_result`` block as a tool turn; 400 if it answers no earlier call."""
    answers = block.get("tool_use_id")
    if not isinstance(answers, str) or answers not in calls:
        message = f"{path}.tool_use_id: answers no tool_use block of an earlier message"
        raise ApiError(400, message, f"{path}.tool_use_id")
    content = block.get("content")
    if content is None:
        text = ""
    else:
        where = f"{path}.content"
        parts = _blocks(content, where)
        text = "".join(
            block_text(b, f"{where}.{k}" if isinstance(content, list) else where, False)
            for k, b in enumerate(parts)
        )
    is_error = block.get("is_error")
    if is_error not in (None, True, False):
        raise ApiError(400, f"{path}.is_error: must be a boolean", f"{path}.is_error")
    return Turn("tool", ERROR_PREFIX + text if is_error else text, call_id=answers)


def block_text(block: Any, path: str, system: bool) -> str:
    """A text block's text; 400 naming the field for anything else."""
    kind = _kind(block, path)
    if kind != "text":
        if system:
            only = "system takes only text blocks"
        elif kind in ("tool_use", "tool_result"):
            side = "assistant" if kind == "tool_use" else "user"
            only = f"{kind} blocks belong in {side} messages' content"
        else:
            only = "only text, tool_use and tool_result blocks are supported"
        shown = repr(kind)[:40]
        later = " yet" if kind in NOT_YET else ""
        here = "here" if kind in ("tool_use", "tool_result") else f"supported{later}"
        message = f"{path}.type: {shown} blocks are not {here} ({only})"
        raise ApiError(400, message, f"{path}.type")
    text = block.get("text")
    if not isinstance(text, str):
        raise ApiError(400, f"{path}.text: must be a string", f"{path}.text")
    return text


def cache_ttl(control: Any, path: str) -> str:
    """The ttl class a ``cache_control`` asks for ("5m" unless it says "1h")."""
    if not isinstance(control, dict):
        raise ApiError(400, f"{path}: must be an object like {{'type': 'ephemeral'}}", path)
    if control.get("type") != "ephemeral":
        shown = repr(control.get("type"))[:40]
        message = f"{path}.type: must be 'ephemeral', got {shown}"
        raise ApiError(400, message, f"{path}.type")
    ttl = control.get("ttl")
    ttl = ANTHROPIC_DEFAULT_TTL if ttl is None else ttl
    if ttl not in ANTHROPIC_TTLS:
        allowed = " or ".join(repr(t) for t in ANTHROPIC_TTLS)
        message = f"{path}.ttl: must be {allowed}, got {repr(ttl)[:40]}"
        raise ApiError(400, message, f"{path}.ttl")
    return ttl


def check_breakpoints(marks: list[Breakpoint]) -> None:
    """At most MAX_ANTHROPIC_BREAKPOINTS, and every "1h" one before every "5m" one."""
    if len(marks) > MAX_ANTHROPIC_BREAKPOINTS:
        extra = marks[MAX_ANTHROPIC_BREAKPOINTS].path
        message = (
            f"{extra}: {len(marks)} cache_control breakpoints; at most "
            f"{MAX_ANTHROPIC_BREAKPOINTS} are allowed per request"
        )
        raise ApiError(400, message, extra)
    first_short: Breakpoint | None = None
    for mark in marks:  # in prompt order
        if mark.ttl != "1h":
            first_short = first_short or mark
        elif first_short is not None:
            message = (
                f"{mark.path}.ttl: a '1h' breakpoint must come before every "
                f"'{first_short.ttl}' one, and {first_short.path} comes first"
            )
            raise ApiError(400, message, f"{mark.path}.ttl")
