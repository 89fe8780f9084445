"""What a completion's text must match: one JSON value, or text and tool calls.

These are plain data (no torch, no grammar library): the server builds them from
``response_format`` and ``tools``/``tool_choice``; the engine's grammar layer compiles them
(``engine/grammar.py``) and masks each constrained sequence's logits per step. Frozen and
hashable, so a compiled grammar is cached by the constraint itself.

A tool call is written in the generic format the tools prompt asks for (the default model's
chat template has no tool section):
``<tool_call>{"name": "NAME", "arguments": {...}}</tool_call>``, whitespace allowed
around the JSON and between calls.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


def canonical_json(value: object) -> str:
    """One text per JSON value as written (no spaces; key order kept: the output follows a
    schema's property order, as OpenAI's does)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class JsonOutput:
    """The whole output is one JSON value matching a schema (``None``: any JSON object)."""

    schema_json: str | None = None  # canonical_json of the JSON schema


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """One callable function: its name and its arguments' JSON schema."""

    name: str
    parameters_json: str  # canonical_json of the parameters schema ({} accepts any object)


@dataclass(frozen=True, slots=True)
class ToolCalls:
    """Text and/or tool calls (TOOL_CALL_OPEN ... TOOL_CALL_CLOSE, each one call).

    ``auto``: free text without TOOL_CALL_OPEN, then zero or more calls; ``required``: one
    or more calls and no text. ``parallel=False`` allows at most one call (so ``required``
    with it is exactly one: a named ``tool_choice`` is that, with the one tool). Each call's
    ``name`` is one of ``tools`` and its ``arguments`` match that tool's schema.
    """

    tools: tuple[ToolSpec, ...]
    mode: Literal["auto", "required"] = "auto"
    parallel: bool = True


Constraint = JsonOutput | ToolCalls
