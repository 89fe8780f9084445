"""The request bodies of ``POST /tokenize`` and ``POST /detokenize``, in vLLM's shapes.

A tokenize body has either ``prompt`` (tokenized as ``/v1/completions`` tokenizes it) or
``messages`` (rendered as ``/v1/chat/completions`` renders them, tools included); the
token ids are checked against the vocabulary and the context where the model is known
(``server/tokenize.py``).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import ConfigDict, Field, StrictInt, model_validator

from prefixcache.protocol.limits import MAX_MESSAGES, MAX_NAME_CHARS
from prefixcache.protocol.schemas import ChatMessage, NullMeansDefault, refused_extra
from prefixcache.protocol.tool_schemas import MAX_TOOLS, ChatTool

UNSUPPORTED = ("chat_template", "chat_template_kwargs", "mm_processor_kwargs")
TokenId = Annotated[StrictInt, Field(ge=0)]


class TokenizeRequest(NullMeansDefault):
    """``prompt`` or ``messages`` (one of them); unknown fields are ignored."""

    model_config = ConfigDict(extra="allow")

    model: str | None = Field(None, max_length=MAX_NAME_CHARS)  # None: the model served
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    tools: list[ChatTool] = Field(default_factory=list, max_length=MAX_TOOLS)
    add_special_tokens: bool | None = None  # None: as the completion would (prompt: yes)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self

    def unsupported_field(self) -> tuple[str, str] | None:
        """The first field set to something this server does not do, and why."""
        if not self.add_generation_prompt or self.continue_final_message:
            field = "add_generation_prompt" if not self.add_generation_prompt else (
                "continue_final_message"
            )  # fmt: skip
            return field, f"{field}: only a prompt ending in the assistant's turn is served"
        if self.prompt is not None and self.tools:
            return "tools", "tools: apply to messages, not to a prompt"
        return refused_extra(self, UNSUPPORTED)


class DetokenizeRequest(NullMeansDefault):
    """Token ids to text; unknown fields are ignored."""

    model_config = ConfigDict(extra="allow")

    model: str | None = Field(None, max_length=MAX_NAME_CHARS)
    tokens: list[TokenId]

    def unsupported_field(self) -> tuple[str, str] | None:
        return None
