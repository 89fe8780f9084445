"""Function tools in request bodies: definitions, ``tool_choice``, and the calls of past turns.

Shared by /v1/chat/completions (``{"type": "function", "function": {...}}``) and
/v1/responses (``{"type": "function", "name": ...}``). Every check names the field and the
limit, so a bad tool is a 400, never a 500.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from prefixcache.protocol.constraints import ToolCalls, ToolSpec, canonical_json
from prefixcache.protocol.limits import MAX_RESPONSE_SCHEMA_BYTES

MAX_TOOLS = 128  # tools in one request (OpenAI's limit)
MAX_TOOL_NAME = 64
MAX_SCHEMA_DEPTH = 16  # nesting of a parameters schema
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
JSON_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
Mode = Literal["none", "auto", "required"]


def check_tool_name(value: str) -> str:
    """OpenAI's charset for function names: letters, digits, ``_`` and ``-``, 1 to 64."""
    if not TOOL_NAME.fullmatch(value):
        raise ValueError(
            f"must be 1 to {MAX_TOOL_NAME} letters, digits, '_' or '-', got {_short(value)}"
        )
    return value


def check_parameters(value: Any) -> dict:
    """A JSON schema of an object (the arguments); ``{}`` accepts any object."""
    if not isinstance(value, dict):
        raise ValueError("must be a JSON schema object")
    kind = value.get("type", "object")
    if kind != "object":
        raise ValueError(f"must be a schema of type 'object' (the arguments), got {_short(kind)}")
    _check_schema(value, "", 0)
    size = len(canonical_json(value).encode())
    if size > MAX_RESPONSE_SCHEMA_BYTES:
        raise ValueError(f"is {size} bytes as JSON; at most {MAX_RESPONSE_SCHEMA_BYTES} allowed")
    return value


def _check_schema(schema: Any, where: str, depth: int) -> None:
    """Structure only: subschemas are objects or booleans, types are JSON types."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ValueError(f"{where or 'schema'} must be a schema object or boolean")
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(f"schema nested deeper than {MAX_SCHEMA_DEPTH} levels")
    kinds = schema.get("type", [])
    for kind in kinds if isinstance(kinds, list) else [kinds]:
        if kind not in JSON_TYPES:
            raise ValueError(f"{where or 'schema'}.type {_short(kind)} is not a JSON type")
    properties = schema.get("properties", {})
    if not isinstance(properties, dict):
        raise ValueError(f"{where}properties must be an object")
    for name, sub in properties.items():
        _check_schema(sub, f"{where}properties.{name}.", depth + 1)
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ValueError(f"{where}required must be a list of property names")
    for key in ("items", "additionalProperties"):
        if key in schema:
            _check_schema(schema[key], f"{where}{key}.", depth + 1)
    for key in ("anyOf", "oneOf", "allOf"):
        subs = schema.get(key, [])
        if not isinstance(subs, list):
            raise ValueError(f"{where}{key} must be a list of schemas")
        for i, sub in enumerate(subs):
            _check_schema(sub, f"{where}{key}.{i}.", depth + 1)


class FunctionDef(BaseModel):
    """One function a model may call."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=dict)
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return check_tool_name(value)

    @field_validator("parameters", mode="before")
    @classmethod
    def _parameters(cls, value: Any) -> dict:
        return {} if value is None else check_parameters(value)

    def spec(self) -> ToolSpec:
        return ToolSpec(self.name, canonical_json(self.parameters))

    def shown(self) -> dict:
        """What the prompt lists: name, description (if any) and parameters."""
        shown: dict[str, Any] = {"name": self.name}
        if self.description:
            shown["description"] = self.description
        shown["parameters"] = self.parameters
        return shown


class ChatTool(BaseModel):
    """A chat completions tool: ``{"type": "function", "function": {...}}``."""

    type: Literal["function"]
    function: FunctionDef


class ResponsesTool(FunctionDef):
    """A Responses API tool: the function's fields beside ``type``."""

    type: Literal["function"]


class ToolCallFunction(BaseModel):
    name: str
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _object(cls, value: str) -> str:
        return check_arguments(value)


class AssistantToolCall(BaseModel):
    """A call an assistant message made in an earlier turn."""

    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: ToolCallFunction


def check_arguments(value: str) -> str:
    """A call's arguments: the text of a JSON object."""
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise ValueError("must be the text of a JSON object")
    return value


def tool_choice(
    value: Any, tools: list[FunctionDef], field: str = "tool_choice"
) -> tuple[Mode, str | None]:
    """``(mode, name)`` of a tool_choice (chat or Responses shape); ValueError naming why."""
    if value is None:
        return ("auto" if tools else "none"), None
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise ValueError(f"{field} must be 'none', 'auto', 'required' or a function")
        if value == "required" and not tools:
            raise ValueError(f"{field} 'required' needs tools")
        return value, None  # type: ignore[return-value]
    if not isinstance(value, dict) or value.get("type") != "function":
        raise ValueError(f"{field} must be 'none', 'auto', 'required' or a function")
    function = value.get("function")
    name = function.get("name") if isinstance(function, dict) else value.get("name")
    if not isinstance(name, str):
        raise ValueError(f"{field} names no function")
    if name not in {t.name for t in tools}:
        raise ValueError(f"{field} names {_short(name)}, which is not one of the tools")
    return "required", name


def constraint(
    tools: list[FunctionDef], mode: Mode, name: str | None, parallel: bool
) -> ToolCalls | None:
    """What the output must match; None for no tools or ``tool_choice: none``.

    A named choice is exactly one call of that tool, whatever ``parallel`` says (OpenAI's
    "call exactly one specific function"): a model that may write more repeats the call."""
    if not tools or mode == "none":
        return None
    if name is not None:
        (named,) = [t for t in tools if t.name == name]
        return ToolCalls((named.spec(),), "required", parallel=False)
    return ToolCalls(tuple(t.spec() for t in tools), mode, parallel)


def unique_names(tools: list[FunctionDef]) -> None:
    """ValueError if two tools share a name (a call could not say which it means)."""
    seen: set[str] = set()
    for tool in tools:
        if tool.name in seen:
            raise ValueError(f"two tools are named {tool.name!r}")
        seen.add(tool.name)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
