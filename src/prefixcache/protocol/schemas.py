"""Request bodies of the OpenAI API, as far as this server implements them.

``null`` for any field means its default. Fields that take several shapes (``prompt``,
``stop``, message ``content``) are checked by hand, so an error names the field and what
it accepts, never one of pydantic's union branches.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from prefixcache.protocol.cache_controls import (
    MAX_CACHE_KEY_CHARS,
    OPENAI_ALIASES,
    OPENAI_RETENTION,
    openai_retention_class,
)
from prefixcache.protocol.limits import MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_NAME_CHARS, MAX_PROMPTS
from prefixcache.protocol.priority import PriorityField
from prefixcache.protocol.sampling_limits import (
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_REQUEST_SEED,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    MIN_REPETITION_PENALTY,
    MIN_REQUEST_SEED,
    MIN_TEMPERATURE,
    MIN_TOP_P,
)
from prefixcache.protocol.tool_schemas import MAX_TOOLS, AssistantToolCall, ChatTool

UNSUPPORTED = ("functions", "suffix")  # rejected when set to anything but empty


def refused_extra(request: BaseModel, names: tuple[str, ...]) -> tuple[str, str] | None:
    """The first of ``names`` a request sets (an extra field, non-empty), and the refusal."""
    extra = request.model_extra or {}
    name = next((name for name in names if extra.get(name)), None)
    return None if name is None else (name, f"{name} is not supported by this server")


TokenIds = list[int]
TEXT_PART = {
    "type": "object",
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    "required": ["type", "text"],
}
CONTENT_SCHEMA = {
    "anyOf": [
        {"type": "string"},
        {"type": "array", "items": TEXT_PART, "maxItems": MAX_CONTENT_PARTS},
        {"type": "null"},
    ]
}
TOKEN_IDS_SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
PROMPT_SCHEMA = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        TOKEN_IDS_SCHEMA,
        {
            "type": "array",
            "items": {"anyOf": [{"type": "string", "minLength": 1}, TOKEN_IDS_SCHEMA]},
            "minItems": 1,
            "maxItems": MAX_PROMPTS,
        },
    ]
}
RETENTION_SCHEMA = {"anyOf": [{"enum": [*OPENAI_RETENTION, *OPENAI_ALIASES]}, {"type": "null"}]}
STOP_SCHEMA = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        {
            "type": "array",
            "items": {"type": "string", "minLength": 1},
            "maxItems": MAX_STOP_STRINGS,
        },
        {"type": "null"},
    ]
}


def _drop_nulls(data: Any) -> Any:
    """``{"field": null}`` means the field's default."""
    if isinstance(data, dict):
        return {key: value for key, value in data.items() if value is not None}
    return data


def _greedy_or_warm(value: float) -> float:
    """A temperature is 0 (greedy) or at least MIN_TEMPERATURE."""
    if 0.0 < value < MIN_TEMPERATURE:
        raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE:g}")
    return value


Temperature = Annotated[float, AfterValidator(_greedy_or_warm)]  # every route's temperature


class NullMeansDefault(BaseModel):
    """A body in which ``null`` for a field means the field's default."""

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        return _drop_nulls(data)


class StreamOptions(NullMeansDefault):
    include_usage: bool = False


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    # str, text parts, or null (assistant)
    content: Any = Field(None, validate_default=True, json_schema_extra=CONTENT_SCHEMA)
    tool_calls: list[AssistantToolCall] | None = Field(None, max_length=MAX_TOOLS)  # assistant
    tool_call_id: str | None = Field(None, max_length=256)  # tool: the call it answers

    @field_validator("content")
    @classmethod
    def _text_only(cls, value: Any) -> str:
        if value is None or isinstance(value, str):
            return value or ""
        if not isinstance(value, list):
            raise ValueError("must be a string or a list of text parts")
        if len(value) > MAX_CONTENT_PARTS:
            raise ValueError(f"{len(value)} parts; at most {MAX_CONTENT_PARTS} allowed")
        texts = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"part {i} is {_short(kind)}: only text parts are supported")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"part {i} has no text string")
            texts.append(part["text"])
        return "".join(texts)

    def text(self) -> str:
        """The message content as one string (text parts joined)."""
        return self.content


class PromptCacheFields(BaseModel):
    """OpenAI's prompt-caching controls (``protocol/cache_controls.py``), on every route
    that takes them: a retention class, and a per-tenant key."""

    prompt_cache_retention: Any = Field(None, json_schema_extra=RETENTION_SCHEMA)
    prompt_cache_key: str | None = Field(None, max_length=MAX_CACHE_KEY_CHARS)

    @field_validator("prompt_cache_retention")
    @classmethod
    def _retention(cls, value: Any) -> str | None:
        return None if value is None else openai_retention_class(value)


class SamplingFields(NullMeansDefault, PromptCacheFields, PriorityField):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(max_length=MAX_NAME_CHARS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    temperature: Temperature = Field(1.0, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float = Field(1.0, ge=MIN_TOP_P, le=1.0)
    top_k: int = Field(0, ge=-1)  # 0 or -1: no limit
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int = Field(0, ge=0)
    stop: Any = Field(None, validate_default=True, json_schema_extra=STOP_SCHEMA)
    stop_token_ids: list[int] = Field(default_factory=list, max_length=64)
    seed: int | None = Field(None, ge=MIN_REQUEST_SEED, le=MAX_REQUEST_SEED)
    presence_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    repetition_penalty: float = Field(1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    logit_bias: dict[str, float] = Field(default_factory=dict)
    response_format: Any = None  # read by protocol/response_format.py
    user: str | None = Field(None, max_length=MAX_NAME_CHARS)
    cache_salt: str | None = Field(None, max_length=MAX_NAME_CHARS)
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: Any) -> list[str]:
        stops = [value] if isinstance(value, str) else value if value is not None else []
        if (
            not isinstance(stops, list)
            or len(stops) > MAX_STOP_STRINGS
            or not all(isinstance(s, str) and s for s in stops)
        ):
            raise ValueError(
                f"must be a string or a list of at most {MAX_STOP_STRINGS} non-empty strings"
            )
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value: dict[str, float]) -> dict[str, float]:
        if len(value) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS_TOKENS} token ids, got {len(value)}")
        for key, bias in value.items():
            if not key.isdigit():
                raise ValueError(f"keys must be token ids (non-negative integers), got {key!r}")
            if abs(bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, value: list[int]) -> list[int]:
        if any(t < 0 for t in value):
            raise ValueError("token ids must be >= 0")
        return value

    def unsupported_field(self) -> tuple[str, str] | None:
        """The first field set to something this server does not do, and why."""
        refused = refused_extra(self, UNSUPPORTED)
        if refused is not None:
            return refused
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", f"best_of must equal n ({self.n}): only best_of == n is supported"
        return None

    def top_k_limit(self) -> int:
        return max(self.top_k, 0)

    def bias(self) -> dict[int, float]:
        return {int(key): value for key, value in self.logit_bias.items()}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ChatTool] = Field(default_factory=list, max_length=MAX_TOOLS)
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", ...}
    parallel_tool_calls: bool = True

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprob_count(self) -> int | None:
        """Top logprobs per generated token; None: no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def unsupported_field(self) -> tuple[str, str] | None:
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        return super().unsupported_field()


class CompletionRequest(SamplingFields):
    prompt: Any = Field(json_schema_extra=PROMPT_SCHEMA)
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, value: Any) -> list[str | TokenIds]:
        """One prompt or a batch: a string, token ids, or a list of either."""
        if isinstance(value, str) or _is_token_ids(value):
            value = [value]
        _no_negative_ids(value)
        if not isinstance(value, list) or not value:
            raise ValueError("must be a string, a list of token ids, or a non-empty list of either")
        if len(value) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(value)}")
        for i, prompt in enumerate(value):
            if not (isinstance(prompt, str) or _is_token_ids(prompt)):
                raise ValueError(f"prompt {i} must be a string or a list of token ids >= 0")
            if not prompt:
                raise ValueError(f"prompt {i} is empty")
        return value

    def token_limit(self) -> int | None:
        return self.max_tokens

    def logprob_count(self) -> int | None:
        return self.logprobs

    def prompt_logprob_count(self) -> int | None:
        """Prompt logprobs (echo with logprobs, as lm-evaluation-harness asks); None: none."""
        if self.echo and self.logprobs is not None:
            return self.logprobs
        return 0 if self.max_tokens == 0 else None


def _no_negative_ids(prompts: Any) -> None:
    """A clear message for ``[-1]`` (which would otherwise read as a batch of bad prompts)."""
    for prompt in prompts if isinstance(prompts, list) else []:
        ids = prompt if isinstance(prompt, list) else [prompt]
        bad = next((t for t in ids if type(t) is int and t < 0), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is negative: token ids are >= 0")


def _short(value: Any) -> str:
    """A client's value quoted in a message, cut to 40 characters."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    )
