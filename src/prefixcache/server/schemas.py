"""Request bodies of the OpenAI API, as far as this server implements them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from prefixcache.engine.sampling import MAX_N, MAX_SEED, MAX_STOP_STRINGS, MAX_TEMPERATURE

UNSUPPORTED = (
    "logprobs",
    "top_logprobs",
    "tools",
    "functions",
    "logit_bias",
    "suffix",
    "best_of",
    "echo",
    "response_format",
)


class StreamOptions(BaseModel):
    include_usage: bool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]

    def text(self) -> str:
        """The message content as one string (text parts joined)."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class SamplingFields(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(extra="allow")

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float = Field(1.0, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = Field(None, validate_default=True)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    user: str | None = Field(None, max_length=256)
    cache_salt: str | None = Field(None, max_length=256)
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP_STRINGS or not all(stops):
            raise ValueError(f"stop must be at most {MAX_STOP_STRINGS} non-empty strings")
        return stops

    def unsupported_field(self) -> str | None:
        """The first OpenAI field set that this server does not implement."""
        extra = self.model_extra or {}
        return next((name for name in UNSUPPORTED if extra.get(name)), None)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str]
    max_tokens: int | None = Field(16, ge=1)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[int] | list[str]) -> str | list[int]:
        if isinstance(value, list) and value and isinstance(value[0], str):
            if len(value) != 1:
                raise ValueError("send one prompt per request (a list of 1 string)")
            value = value[0]
        if not value:
            raise ValueError("prompt is empty")
        return value

    def token_limit(self) -> int | None:
        return self.max_tokens
