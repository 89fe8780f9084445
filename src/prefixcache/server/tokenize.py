"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes): the server's own token ids.

A prompt is tokenized as ``/v1/completions`` tokenizes it and chat messages as
``/v1/chat/completions`` renders them (``prepare.completion_tokens``, ``prepare.chat_prompt``:
one home each), so the ids are exactly what a completion of the same body prefills, and
the same limits apply (characters before tokenizing, the context after). Runs on a
prepare thread; never logs a text or an id.
"""

from __future__ import annotations

from prefixcache.protocol.errors import ApiError
from prefixcache.protocol.tokenize_schemas import DetokenizeRequest, TokenizeRequest
from prefixcache.server.prepare import (
    PrepareContext,
    chat_prompt,
    check_tokens,
    check_vocabulary,
    completion_tokens,
    parse_body,
    too_many_chars,
    tool_rules,
)


def tokenize(raw: bytes, ctx: PrepareContext) -> dict:
    """``{"count", "max_model_len", "tokens", "token_strs"}`` of a prompt or a chat body."""
    body: TokenizeRequest = parse_body(raw, TokenizeRequest, ctx)  # type: ignore[assignment]
    if body.messages is not None:
        ids = _chat_ids(body, ctx)
    else:
        prompt = body.prompt or ""
        if len(prompt) > ctx.max_prompt_chars:
            raise ApiError(400, too_many_chars("prompt", len(prompt), ctx), "prompt")
        special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = completion_tokens(ctx, prompt, special)
        check_tokens([ids], ctx, "prompt")
    strings = None
    if body.return_token_strs:
        strings = [ctx.tokenizer.backend.id_to_token(i) for i in ids]
    return {"count": len(ids), "max_model_len": ctx.context, "tokens": ids, "token_strs": strings}


def _chat_ids(body: TokenizeRequest, ctx: PrepareContext) -> list[int]:
    """The messages' ids as a chat completion of them prefills (tools checked as chat's)."""
    if body.add_special_tokens:
        message = (
            "add_special_tokens: messages are tokenized as a chat completion prefills them "
            "(the chat template writes any special tokens); it must be false"
        )
        raise ApiError(400, message, "add_special_tokens")
    tools = [t.function for t in body.tools]
    tool_rules(tools, None, True, "tools")  # the same checks as chat's (unique names)
    return chat_prompt(ctx, body.messages or [], tools)


def detokenize(raw: bytes, ctx: PrepareContext) -> dict:
    """``{"prompt"}``: the text of token ids (special tokens written out, as a prompt has
    them); at most the model's context of ids, each in its vocabulary."""
    body: DetokenizeRequest = parse_body(raw, DetokenizeRequest, ctx)  # type: ignore[assignment]
    if len(body.tokens) > ctx.context:
        message = (
            f"tokens has {len(body.tokens)} ids; at most {ctx.context} (this model's "
            "max_model_len) are decoded"
        )
        raise ApiError(400, message, "tokens")
    check_vocabulary(body.tokens, ctx, "tokens", "tokens")
    return {"prompt": ctx.tokenizer.decode(body.tokens, skip_special_tokens=False)}
