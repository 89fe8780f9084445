"""A Messages API body as turns of text and its cache breakpoints, checked block by block.

Every error is a 400 naming the block's field (``messages.2.content.1.cache_control.ttl``).
A breakpoint is a ``cache_control`` on a text block (or the request's own, on its last
block): the prompt through the end of that block is to stay cached for its ttl.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prefixcache.protocol.anthropic_schemas import MessagesRequest
from prefixcache.protocol.cache_controls import (
    ANTHROPIC_DEFAULT_TTL,
    ANTHROPIC_TTLS,
    MAX_ANTHROPIC_BREAKPOINTS,
)
from prefixcache.protocol.errors import ApiError

NOT_YET = ("image", "document", "tool_use", "tool_result", "thinking", "redacted_thinking")


@dataclass(slots=True)
class Turn:
    """One message of the rendered conversation: its role and its text blocks."""

    role: str
    texts: list[str] = field(default_factory=list)

    @property
    def content(self) -> str:
        return "".join(self.texts)


@dataclass(frozen=True, slots=True)
class Breakpoint:
    """The end of a marked block: turn index, characters of that turn's content, ttl."""

    turn: int
    chars: int
    ttl: str
    path: str  # the field that asked for it


def conversation(body: MessagesRequest) -> tuple[list[Turn], list[Breakpoint]]:
    """The turns (system first, if any) and the breakpoints in prompt order, checked."""
    turns: list[Turn] = []
    marks: list[Breakpoint] = []
    if body.system is not None:
        turns.append(Turn("system"))
        _add_content(turns, marks, body.system, "system", system=True)
    for i, message in enumerate(body.messages):
        turns.append(Turn(message.role))
        _add_content(turns, marks, message.content, f"messages.{i}.content", system=False)
    if body.cache_control is not None:
        ttl = cache_ttl(body.cache_control, "cache_control")
        last = len(turns) - 1
        marks.append(Breakpoint(last, len(turns[last].content), ttl, "cache_control"))
    check_breakpoints(marks)
    return turns, marks


def _add_content(
    turns: list[Turn], marks: list[Breakpoint], content: Any, path: str, system: bool
) -> None:
    """A string or a list of text blocks onto the last turn, with their breakpoints."""
    turn = turns[-1]
    if isinstance(content, str):
        turn.texts.append(content)
        return
    if not isinstance(content, list):
        what = "a string or a list of text blocks"
        raise ApiError(400, f"{path}: must be {what}, got {type(content).__name__}", path)
    for j, block in enumerate(content):
        where = f"{path}.{j}"
        turn.texts.append(block_text(block, where, system))
        control = block.get("cache_control")
        if control is not None:
            ttl = cache_ttl(control, f"{where}.cache_control")
            at = len(turn.content)
            marks.append(Breakpoint(len(turns) - 1, at, ttl, f"{where}.cache_control"))


def block_text(block: Any, path: str, system: bool) -> str:
    """A text block's text; 400 naming the field for anything else."""
    if not isinstance(block, dict):
        raise ApiError(400, f"{path}: must be a content block object", path)
    kind = block.get("type")
    if kind != "text":
        only = "system takes only text blocks" if system else "only text blocks are supported"
        shown = repr(kind)[:40]
        later = " yet" if kind in NOT_YET else ""
        message = f"{path}.type: {shown} blocks are not supported{later} ({only})"
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
