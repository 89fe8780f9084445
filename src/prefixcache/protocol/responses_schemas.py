"""The request body of ``POST /v1/responses`` (OpenAI's Responses API), the subset served.

``input`` is a string or a list of items (``message``, ``function_call``,
``function_call_output``), checked by hand in ``server/responses_api.py`` so an error
names the item and its field.
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, field_validator

from prefixcache.protocol.limits import MAX_MESSAGES, MAX_NAME_CHARS
from prefixcache.protocol.priority import PriorityField
from prefixcache.protocol.sampling_limits import MAX_TEMPERATURE, MIN_TOP_P
from prefixcache.protocol.schemas import (
    NullMeansDefault,
    PromptCacheFields,
    Temperature,
    refused_extra,
)
from prefixcache.protocol.tool_schemas import MAX_TOOLS, ResponsesTool

INPUT_SCHEMA = {
    "anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "object"}, "maxItems": MAX_MESSAGES},
    ]
}
UNSUPPORTED = ("reasoning", "background", "conversation", "prompt", "include")


class ResponsesRequest(NullMeansDefault, PromptCacheFields, PriorityField):
    """What a client may ask of /v1/responses; other OpenAI fields are refused or ignored."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(max_length=MAX_NAME_CHARS)
    input: Any = Field(json_schema_extra=INPUT_SCHEMA)
    instructions: str | None = None
    tools: list[ResponsesTool] = Field(default_factory=list, max_length=MAX_TOOLS)
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", "name"}
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: Temperature = Field(1.0, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float = Field(1.0, ge=MIN_TOP_P, le=1.0)
    previous_response_id: str | None = Field(None, max_length=MAX_NAME_CHARS)
    store: bool = True
    stream: bool = False
    user: str | None = Field(None, max_length=MAX_NAME_CHARS)
    cache_salt: str | None = Field(None, max_length=MAX_NAME_CHARS)

    @field_validator("input")
    @classmethod
    def _input(cls, value: Any) -> str | list:
        if isinstance(value, str):
            return value
        if not isinstance(value, list) or len(value) > MAX_MESSAGES:
            raise ValueError(f"must be a string or a list of at most {MAX_MESSAGES} items")
        return value

    def unsupported_field(self) -> tuple[str, str] | None:
        """The first field set to something this server does not do, and why."""
        refused = refused_extra(self, UNSUPPORTED)
        if refused is not None:
            return refused
        extra = self.model_extra or {}
        kind = ((extra.get("text") or {}).get("format") or {}).get("type", "text")
        if kind != "text":
            return "text", f"text.format type {kind!r} is not supported (only 'text')"
        return None
