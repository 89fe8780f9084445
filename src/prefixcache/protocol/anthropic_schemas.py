"""The request body of Anthropic's Messages API (``POST /v1/messages``), as far as this
server implements it.

Content (a string or a list of blocks) and ``system`` are checked block by block when the
request is prepared (``server/messages.py``), so an error names the exact block and field;
the schemas here describe them for the OpenAPI document.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator

from prefixcache.protocol.cache_controls import ANTHROPIC_TTLS, MAX_ANTHROPIC_BREAKPOINTS
from prefixcache.protocol.limits import MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_NAME_CHARS
from prefixcache.protocol.sampling_limits import MAX_STOP_STRINGS, MIN_TEMPERATURE, MIN_TOP_P
from prefixcache.protocol.schemas import NullMeansDefault

UNSUPPORTED_FIELDS = ("tools", "tool_choice")  # 400 when set: tool use is another issue
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
BLOCKS = {"type": "array", "items": TEXT_BLOCK, "maxItems": MAX_CONTENT_PARTS}
CONTENT_SCHEMA = {"anyOf": [{"type": "string"}, BLOCKS]}
SYSTEM_SCHEMA = {"anyOf": [{"type": "string"}, BLOCKS, {"type": "null"}]}


class AnthropicMessage(NullMeansDefault):
    """One turn; its content is checked when the request is prepared."""

    role: Literal["user", "assistant"]
    content: Any = Field(json_schema_extra=CONTENT_SCHEMA)


class MessagesRequest(NullMeansDefault):
    """``POST /v1/messages``: unknown fields are ignored, tool fields refused."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(max_length=MAX_NAME_CHARS)
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: Any = Field(None, json_schema_extra=SYSTEM_SCHEMA)
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    top_p: float = Field(1.0, ge=MIN_TOP_P, le=1.0)
    top_k: int = Field(0, ge=0)  # 0: no limit
    stop_sequences: list[str] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    stream: bool = False
    metadata: dict[str, Any] | None = None  # accepted, ignored
    cache_control: dict[str, Any] | None = Field(
        None,
        json_schema_extra=CACHE_CONTROL_SCHEMA,
        description=f"one automatic breakpoint at the end of the last block "
        f"(at most {MAX_ANTHROPIC_BREAKPOINTS} in all)",
    )

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value: float) -> float:
        if 0.0 < value < MIN_TEMPERATURE:
            raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE:g}")
        return value

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
        """The first field set to something this server does not do yet, and why."""
        extra = self.model_extra or {}
        name = next((name for name in UNSUPPORTED_FIELDS if extra.get(name)), None)
        if name is None:
            return None
        return name, f"{name}: tool use is not supported yet on /v1/messages"
