"""The request body of Anthropic's Messages API (``POST /v1/messages``), as far as this
server implements it.

Content (a string or a list of blocks) and ``system`` are checked block by block when the
request is prepared (``server/messages.py``), so an error names the exact block and field;
the schemas here describe them for the OpenAPI document. Tools are Anthropic's shape
(``name``, ``description``, ``input_schema``) checked by the OpenAI routes' rules.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from prefixcache.protocol.cache_controls import ANTHROPIC_TTLS, MAX_ANTHROPIC_BREAKPOINTS
from prefixcache.protocol.limits import MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_NAME_CHARS
from prefixcache.protocol.priority import PriorityField
from prefixcache.protocol.sampling_limits import MAX_STOP_STRINGS, MIN_TOP_P
from prefixcache.protocol.schemas import NullMeansDefault, Temperature
from prefixcache.protocol.tool_schemas import (
    MAX_TOOLS,
    FunctionDef,
    check_parameters,
    check_tool_name,
)

CACHE_CONTROL_SCHEMA = {
    "type": "object",
    "properties": {"type": {"const": "ephemeral"}, "ttl": {"enum": list(ANTHROPIC_TTLS)}},
    "required": ["type"],
}
TEXT_BLOCK = {
    "type": "object",
    "properties": {
        "type": {"const": "text"},
        "text": {"type": "string"},
        "cache_control": {"anyOf": [CACHE_CONTROL_SCHEMA, {"type": "null"}]},
    },
    "required": ["type", "text"],
}
TOOL_USE_BLOCK = {
    "type": "object",
    "properties": {
        "type": {"const": "tool_use"},
        "id": {"type": "string"},
        "name": {"type": "string"},
        "input": {"type": "object"},
    },
    "required": ["type", "id", "name", "input"],
}
TOOL_RESULT_BLOCK = {
    "type": "object",
    "properties": {
        "type": {"const": "tool_result"},
        "tool_use_id": {"type": "string"},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": TEXT_BLOCK}]},
        "is_error": {"type": "boolean"},
    },
    "required": ["type", "tool_use_id"],
}
BLOCKS = {"type": "array", "items": TEXT_BLOCK, "maxItems": MAX_CONTENT_PARTS}
ANY_BLOCKS = {
    "type": "array",
    "items": {"anyOf": [TEXT_BLOCK, TOOL_USE_BLOCK, TOOL_RESULT_BLOCK]},
    "maxItems": MAX_CONTENT_PARTS,
}
CONTENT_SCHEMA = {"anyOf": [{"type": "string"}, ANY_BLOCKS]}
TOOL_CHOICE_SCHEMA = {
    "type": "object",
    "properties": {
        "type": {"enum": ["auto", "any", "tool", "none"]},
        "name": {"type": "string"},
        "disable_parallel_tool_use": {"type": "boolean"},
    },
    "required": ["type"],
}
SYSTEM_SCHEMA = {"anyOf": [{"type": "string"}, BLOCKS, {"type": "null"}]}


class AnthropicMessage(NullMeansDefault):
    """One turn; its content is checked when the request is prepared."""

    role: Literal["user", "assistant"]
    content: Any = Field(json_schema_extra=CONTENT_SCHEMA)


class AnthropicTool(BaseModel):
    """A client tool: its name, what it does, its input's JSON schema (an object's)."""

    type: Literal["custom"] | None = None
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = Field(None, json_schema_extra=CACHE_CONTROL_SCHEMA)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return check_tool_name(value)

    @field_validator("input_schema", mode="before")
    @classmethod
    def _schema(cls, value: Any) -> dict:
        return check_parameters(value)

    def function(self) -> FunctionDef:
        """The same function an OpenAI tool with these fields is (so it renders the same)."""
        return FunctionDef(
            name=self.name, description=self.description, parameters=self.input_schema
        )


class MessagesRequest(NullMeansDefault, PriorityField):
    """``POST /v1/messages``: unknown fields are ignored."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(max_length=MAX_NAME_CHARS)
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: Any = Field(None, json_schema_extra=SYSTEM_SCHEMA)
    temperature: Temperature = Field(1.0, ge=0.0, le=1.0)
    top_p: float = Field(1.0, ge=MIN_TOP_P, le=1.0)
    top_k: int = Field(0, ge=0)  # 0: no limit
    stop_sequences: list[str] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    stream: bool = False
    tools: list[AnthropicTool] = Field(default_factory=list, max_length=MAX_TOOLS)
    tool_choice: dict[str, Any] | None = Field(None, json_schema_extra=TOOL_CHOICE_SCHEMA)
    metadata: dict[str, Any] | None = None  # accepted, ignored
    cache_control: dict[str, Any] | None = Field(
        None,
        json_schema_extra=CACHE_CONTROL_SCHEMA,
        description=f"one automatic breakpoint at the end of the last block "
        f"(at most {MAX_ANTHROPIC_BREAKPOINTS} in all)",
    )

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, value: list[str]) -> list[str]:
        if not all(value):
            raise ValueError("stop sequences must be non-empty strings")
        return value

    @property
    def cache_salt(self) -> None:
        """The OpenAI routes' client salt; this API has none (the tenant's salt alone)."""
        return None

    def unsupported_field(self) -> tuple[str, str] | None:
        """Nothing this route refuses outright (blocks are checked one by one)."""
        return None


class CountTokensRequest(MessagesRequest):
    """``POST /v1/messages/count_tokens``: a Messages body, ``max_tokens`` not needed (the
    sampling fields are checked as ``/v1/messages`` checks them, then ignored)."""

    max_tokens: int | None = Field(None, ge=1)  # type: ignore[assignment]
