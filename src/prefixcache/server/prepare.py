"""A request body turned into engine work: parse, validate, check limits, template, tokenize.

Everything here is synchronous and runs in the prepare pool, off the event loop; every
limit is checked before the step it protects (characters before tokenizing, tokens after).
Errors are ApiErrors naming the field and the limit.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel, ValidationError

from prefixcache.cache.retention import Keep
from prefixcache.engine.chat_template import NoChatTemplate
from prefixcache.engine.grammar import grammar_cache
from prefixcache.engine.sampling_params import SamplingParams, fold_seed
from prefixcache.engine.tokenizer import Tokenizer
from prefixcache.protocol import tool_prompt, tool_schemas
from prefixcache.protocol.constraints import Constraint
from prefixcache.protocol.errors import ApiError, field_path
from prefixcache.protocol.json_body import load_json
from prefixcache.protocol.response_format import SCHEMA_FIELD, response_format_constraint
from prefixcache.protocol.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)
from prefixcache.server import openai_format

Prompts = list[list[int]]  # one token-id prompt per engine request


@dataclass(frozen=True, slots=True)
class PrepareContext:
    """What preparing reads (fixed once the server starts, so safe from any thread)."""

    tokenizer: Tokenizer
    model_name: str
    context: int  # the model's context in tokens
    vocab_size: int
    max_prompt_chars: int
    block_size: int = 16  # the cache's tokens per block (usage of retained prefixes)


def longest_token_chars(tokenizer: Tokenizer) -> int:
    """Characters of the longest vocabulary entry: no token covers more text than that."""
    return max(len(token) for token in tokenizer.backend.get_vocab(with_added_tokens=True))


def max_prompt_chars(tokenizer: Tokenizer, context: int) -> int:
    """Characters above which a prompt cannot fit ``context`` tokens, checked before tokenizing.

    Each token covers at most ``longest_token_chars`` characters (a byte-level entry is at
    least as long as the text it stands for), so this never refuses a prompt that fits.
    """
    return context * longest_token_chars(tokenizer)


@dataclass(slots=True)
class Prepared:
    """A request ready for the engine: one token-id prompt per engine request."""

    body: SamplingFields
    prompts: Prompts
    params: SamplingParams
    shape: openai_format.Shape  # or, for /v1/messages, anthropic_format.MessageShape
    retention: tuple[Keep, ...] = ()  # prompt prefixes to keep cached (cache_control)


def prepare_chat(raw: bytes, ctx: PrepareContext) -> Prepared:
    """A chat body: its messages' text bounded, templated and tokenized."""
    body = parse_body(raw, ChatCompletionRequest, ctx)
    tools = [t.function for t in body.tools]
    rules = tool_rules(tools, body.tool_choice, body.parallel_tool_calls, "tool_choice")
    prompts = [chat_prompt(ctx, body.messages, tools)]
    shape = _shape(body, ctx, chat=True)
    shape.tool_names = rules.names
    return Prepared(body, prompts, _sampling(body, prompts, ctx, rules.constraint), shape)


def chat_prompt(ctx: PrepareContext, messages: list, tools: list) -> list[int]:
    """The one way chat messages (and their tools) become prompt tokens; 400 naming the
    field for a tool result that answers no call, or a prompt past the context."""
    turns = tool_prompt.chat_turns(messages)
    lost = tool_prompt.unanswerable(turns)
    if lost is not None:
        field = f"messages.{lost}.tool_call_id"
        raise ApiError(400, f"{field}: answers no tool call of an earlier message", field)
    return render_prompt(ctx, turns, tools, "messages")


@dataclass(frozen=True, slots=True)
class ToolRules:
    """What tools do to a request: the output constraint and the names calls may use."""

    constraint: Constraint | None = None
    names: frozenset[str] | None = None  # None: no call is parsed out of the text


def tool_rules(tools: list, choice: object, parallel: bool, field: str) -> ToolRules:
    """The constraint for ``tool_choice``; 400 naming ``field`` for a choice that cannot be."""
    try:
        tool_schemas.unique_names(tools)
        mode, name = tool_schemas.tool_choice(choice, tools, field)
    except ValueError as error:
        if str(error).startswith("two tools"):
            raise ApiError(400, f"tools: {error}", "tools") from None
        raise ApiError(400, str(error), field) from None
    constraint = tool_schemas.constraint(tools, mode, name, parallel)
    if constraint is None:
        return ToolRules()
    return ToolRules(constraint, frozenset(t.name for t in constraint.tools))


def render_prompt(
    ctx: PrepareContext, turns: list[tool_prompt.Turn], tools: list, field: str
) -> list[int]:
    """The conversation's token ids, its size checked before and after tokenizing."""
    chars = sum(len(t.content) + sum(len(c.arguments) for c in t.calls) for t in turns)
    if chars > ctx.max_prompt_chars:
        raise ApiError(400, too_many_chars(field, chars, ctx), field)
    text = template_text(lambda: tool_prompt.render(ctx.tokenizer, turns, tools), field)
    prompt = ctx.tokenizer.encode(text)
    check_tokens([prompt], ctx, field)
    return prompt


def template_text(render: Callable[[], str], field: str) -> str:
    """What ``render`` returns; a 400 if the model has no chat template (naming
    ``--chat-template``) or the template fails (naming ``field``)."""
    try:
        return render()
    except NoChatTemplate as error:
        raise ApiError(400, str(error)) from None
    except ValueError as error:
        raise ApiError(400, f"{field}: {error}", field) from None


def prepare_completion(raw: bytes, ctx: PrepareContext) -> Prepared:
    """A completions body: each prompt bounded, then tokenized (or its ids checked)."""
    body = parse_body(raw, CompletionRequest, ctx)
    for i, prompt in enumerate(body.prompt):
        _check_prompt_size(i, prompt, ctx)
    texts = [p for p in body.prompt if isinstance(p, str)]
    encoded = iter([completion_tokens(ctx, text) for text in texts])
    prompts = [next(encoded) if isinstance(p, str) else p for p in body.prompt]
    check_tokens(prompts, ctx, "prompt")
    shape = _shape(body, ctx, chat=False)
    if body.echo:
        shape.echo = [
            p if isinstance(p, str) else ctx.tokenizer.decode(p, skip_special_tokens=False)
            for p in body.prompt
        ]
    return Prepared(body, prompts, _sampling(body, prompts, ctx), shape)


def completion_tokens(ctx: PrepareContext, text: str, add_special_tokens: bool = True) -> list[int]:
    """A text prompt's ids as a completion prefills them (its BOS included)."""
    return ctx.tokenizer.encode(text, add_special_tokens=add_special_tokens)


def parse_body(raw: bytes, schema: type[BaseModel], ctx: PrepareContext) -> SamplingFields:
    """The body as ``schema``: 400 for bad JSON or a bad field, 404 for another model."""
    data = load_json(raw)
    try:
        body = schema.model_validate(data)
    except ValidationError as error:
        raise _field_error(error) from None
    unsupported = body.unsupported_field()
    if unsupported:
        raise ApiError(400, unsupported[1], unsupported[0])
    if body.model is not None and body.model != ctx.model_name:  # None: optional, unset
        raise ApiError(404, no_such_model(body.model, ctx.model_name), "model")
    return body


def no_such_model(name: str, served: str) -> str:
    return f"model {name!r} does not exist; this server serves {served!r}"


def _field_error(error: ValidationError) -> ApiError:
    """400 naming the first bad field (its path) and what it accepts."""
    first = error.errors()[0]
    field = field_path(first["loc"])
    message = first["msg"].removeprefix("Value error, ")
    return ApiError(400, f"{field}: {message}", field)


def too_many_chars(field: str, chars: int, ctx: PrepareContext) -> str:
    return (
        f"{field} has {chars} characters; at most {ctx.max_prompt_chars} can fit this "
        f"model's context of {ctx.context} tokens"
    )


def _check_prompt_size(index: int, prompt: str | list[int], ctx: PrepareContext) -> None:
    """Before tokenizing: characters of a text prompt, the vocabulary of token ids."""
    if isinstance(prompt, str):
        if len(prompt) > ctx.max_prompt_chars:
            raise ApiError(400, too_many_chars(f"prompt {index}", len(prompt), ctx), "prompt")
        return
    check_vocabulary(prompt, ctx, f"prompt {index}", "prompt")


def check_vocabulary(ids: list[int], ctx: PrepareContext, name: str, field: str) -> None:
    """400 naming ``field`` for the first id outside the model's vocabulary."""
    bad = next((t for t in ids if t >= ctx.vocab_size), None)
    if bad is not None:
        message = f"{name}: token id {bad} is outside the vocabulary [0, {ctx.vocab_size})"
        raise ApiError(400, message, field)


def check_tokens(prompts: Prompts, ctx: PrepareContext, param: str) -> None:
    """Every prompt leaves room for at least one generated token."""
    for i, prompt in enumerate(prompts):
        if len(prompt) >= ctx.context:
            name = "messages" if param == "messages" else f"prompt {i}"
            raise ApiError(
                400,
                f"{name} has {len(prompt)} tokens; this model's context is {ctx.context} "
                "tokens (including at least 1 generated)",
                param,
            )


def check_room(limit: int | None, prompts: Prompts, context: int) -> None:
    """400 unless every prompt leaves room for the requested tokens (at least 1)."""
    for prompt in prompts:
        room = context - len(prompt)
        if room < 1 or (limit is not None and limit > room):
            raise ApiError(
                400,
                f"this model's context is {context} tokens; the prompt has "
                f"{len(prompt)} and {limit or 1} more were requested",
                "max_tokens",
            )


def _sampling(
    body: SamplingFields,
    prompts: Prompts,
    ctx: PrepareContext,
    constraint: Constraint | None = None,
) -> SamplingParams:
    """Sampling parameters, with the token limit checked against the context."""
    limit = body.token_limit()
    check_room(limit, prompts, ctx.context)
    longest = max(len(p) for p in prompts)
    prompt_logprobs = getattr(body, "prompt_logprob_count", lambda: None)()
    constraint = _constraint(body, ctx, constraint)
    try:
        return SamplingParams(
            n=body.n,
            max_tokens=ctx.context - longest if limit is None else limit,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k_limit(),
            min_p=body.min_p,
            seed=None if body.seed is None else fold_seed(body.seed),
            stop=body.stop,
            stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            logit_bias=body.bias(),
            logprobs=body.logprob_count(),
            prompt_logprobs=prompt_logprobs,
            constraint=constraint,
        )
    except ValueError as error:  # a combination out of range (min_tokens > max_tokens, ...)
        raise ApiError(400, str(error), str(error).split(" ", 1)[0]) from None


def _constraint(
    body: SamplingFields, ctx: PrepareContext, tools: Constraint | None
) -> Constraint | None:
    """What the output must match: the tools' calls or the response format, not both."""
    constraint = response_format_constraint(body.response_format)
    if constraint is None:
        return compiled(tools, ctx, "tools")
    if tools is not None:
        message = (
            "response_format: a JSON format cannot be combined with tools "
            "(unless tool_choice is 'none')"
        )
        raise ApiError(400, message, "response_format")
    return compiled(constraint, ctx, SCHEMA_FIELD)


def compiled(constraint: Constraint | None, ctx: PrepareContext, field: str) -> Constraint | None:
    """``constraint``, compiled here (off the event loop; the engine reuses it); 400 naming
    ``field`` if the grammar cannot compile it."""
    if constraint is None:
        return None
    try:
        grammar_cache(ctx.tokenizer).compile(constraint)
    except ValueError as error:
        raise ApiError(400, f"{field}: {error}", field) from None
    return constraint


def _shape(body: SamplingFields, ctx: PrepareContext, chat: bool) -> openai_format.Shape:
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    return openai_format.Shape(
        request_id,
        body.model,
        chat,
        body.n,
        ctx.tokenizer,
        logprobs=body.logprob_count() is not None,
    )
