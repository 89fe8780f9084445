"""Anthropic's ``tool_choice`` in the OpenAI routes' terms, so one set of rules serves both.

``{"type": "auto"}`` is ``"auto"``, ``{"type": "any"}`` is ``"required"``, ``{"type":
"tool", "name": ...}`` is a named function (exactly one call, as on the OpenAI routes:
Anthropic's one call is always a valid answer, and a small model allowed more repeats it),
``{"type": "none"}`` is ``"none"``; ``disable_parallel_tool_use`` allows at most one call.
"""

from __future__ import annotations

from typing import Any

from prefixcache.protocol.errors import ApiError

MODES = {"auto": "auto", "any": "required", "none": "none"}
KINDS = "'auto', 'any', 'tool' or 'none'"


def openai_tool_choice(value: Any, names: set[str]) -> tuple[object, bool]:
    """``(tool_choice as chat completions spells it, parallel calls allowed)``; 400 naming
    the field otherwise."""
    if value is None:
        return None, True
    if not isinstance(value, dict):
        message = f"tool_choice: must be an object like {{'type': 'auto'}}, got {_short(value)}"
        raise ApiError(400, message, "tool_choice")
    disable = value.get("disable_parallel_tool_use", False)
    if not isinstance(disable, bool):
        field = "tool_choice.disable_parallel_tool_use"
        raise ApiError(400, f"{field}: must be a boolean", field)
    kind = value.get("type")
    if kind in ("any", "tool") and not names:
        raise ApiError(400, f"tool_choice: type {kind!r} needs tools", "tool_choice")
    if kind in MODES:
        return MODES[kind], not disable
    if kind == "tool":
        name = value.get("name")
        if not isinstance(name, str) or name not in names:
            message = f"tool_choice.name: must name one of the tools, got {_short(name)}"
            raise ApiError(400, message, "tool_choice.name")
        return {"type": "function", "name": name}, not disable
    message = f"tool_choice.type: must be {KINDS}, got {_short(kind)}"
    raise ApiError(400, message, "tool_choice.type")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
