"""A Messages API body turned into engine work: turns, chat template, tokens, retention.

The conversation (tools, calls and results included) renders through
``server/tool_prompt.py`` exactly as a chat completion does, so both APIs share cached
blocks; tools constrain the output by the same rules. A breakpoint becomes a ``Keep`` of
the prompt's tokens through the end of its block: the tokens that end at or before the
character where that block's text ends in the rendered prompt.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace

from prefixcache.cache.retention import Keep
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.engine.tokenizer import Tokenizer
from prefixcache.protocol import tool_prompt
from prefixcache.protocol.anthropic_blocks import TOOLS, Breakpoint, conversation
from prefixcache.protocol.anthropic_schemas import CountTokensRequest, MessagesRequest
from prefixcache.protocol.anthropic_tools import openai_tool_choice
from prefixcache.protocol.cache_controls import ANTHROPIC_TTLS
from prefixcache.protocol.constraints import Constraint
from prefixcache.protocol.errors import ApiError
from prefixcache.protocol.tool_schemas import FunctionDef
from prefixcache.protocol.turns import Turn
from prefixcache.server.anthropic_format import MessageShape
from prefixcache.server.prepare import (
    PrepareContext,
    Prepared,
    ToolRules,
    check_room,
    check_tokens,
    compiled,
    parse_body,
    template_text,
    too_many_chars,
    tool_rules,
)

MARK = "\ue000"  # a private-use character: where a breakpoint falls in the rendered text


def prepare_messages(raw: bytes, ctx: PrepareContext) -> Prepared:
    """A Messages body: checked, templated, tokenized, its breakpoints as retention asks."""
    body: MessagesRequest = parse_body(raw, MessagesRequest, ctx)  # type: ignore[assignment]
    built = message_prompt(body, ctx)
    prompt = built.prompt
    check_tokens([prompt], ctx, "messages")
    check_room(body.max_tokens, [prompt], ctx.context)
    keeps = tuple(
        Keep(tokens_before(built.token_ends, end), ANTHROPIC_TTLS[mark.ttl], mark.ttl)
        for mark, end in zip(built.marks, built.mark_ends, strict=True)
    )
    shape = MessageShape(
        f"msg_{uuid.uuid4().hex}", body.model, ctx.tokenizer, body.stop_sequences, keeps,
        ctx.block_size, tool_names=built.rules.names,
    )  # fmt: skip
    sampling = _sampling(body, compiled(built.rules.constraint, ctx, "tools"))
    return Prepared(body, [prompt], sampling, shape, keeps)  # type: ignore[arg-type]


def count_message_tokens(raw: bytes, ctx: PrepareContext) -> dict:
    """``POST /v1/messages/count_tokens``: the prompt tokens ``/v1/messages`` would prefill
    for the same body (counted even past the context, so a client sees by how much)."""
    body = parse_body(raw, CountTokensRequest, ctx)  # type: ignore[assignment]
    return {"input_tokens": len(message_prompt(body, ctx).prompt)}  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class MessagePrompt:
    """A Messages body's prompt: its token ids, where each token ends (characters), the
    breakpoints and where each falls, and the tools' rules."""

    prompt: list[int]
    token_ends: list[int]
    marks: list[Breakpoint]
    mark_ends: list[int]
    rules: ToolRules


def message_prompt(body: MessagesRequest, ctx: PrepareContext) -> MessagePrompt:
    """The one way a Messages body becomes prompt tokens (tools, calls and results
    included); 400 naming the field for a bad tool choice or too many characters."""
    tools = [t.function() for t in body.tools]
    choice, parallel = openai_tool_choice(body.tool_choice, {t.name for t in tools})
    rules = tool_rules(tools, choice, parallel, "tool_choice")
    turns, marks = conversation(body)
    chars = sum(len(t.content) + sum(len(c.arguments) for c in t.calls) for t in turns)
    if chars > ctx.max_prompt_chars:
        raise ApiError(400, too_many_chars("messages", chars, ctx), "messages")
    text, ends = render(ctx.tokenizer, turns, tools, marks)
    encoding = ctx.tokenizer.backend.encode_batch([text], add_special_tokens=False)[0]
    token_ends = [end for _, end in encoding.offsets]
    return MessagePrompt(list(encoding.ids), token_ends, marks, ends, rules)


def render(
    tokenizer: Tokenizer, turns: list[Turn], tools: list[FunctionDef], marks: list[Breakpoint]
) -> tuple[str, list]:
    """The prompt text, and where each breakpoint falls in it (characters)."""
    text = _template(tokenizer, turns, tools)
    if not marks:
        return text, []
    marked = [
        replace(turn, content=_insert_marks(turn.content, _cuts(marks, i)))
        for i, turn in enumerate(turns)
    ]
    suffix = MARK if any(m.turn == TOOLS for m in marks) else ""
    with_marks = _template(tokenizer, marked, tools, suffix)
    unique = sorted({(m.turn, m.chars) for m in marks})
    if with_marks.replace(MARK, "") != text or with_marks.count(MARK) != len(unique):
        return text, _searched_ends(text, turns, marks)  # the template rewrote the content
    found, positions = 0, []
    for at, char in enumerate(with_marks):
        if char == MARK:
            positions.append(at - found)
            found += 1
    return text, [positions[unique.index((m.turn, m.chars))] for m in marks]


def _template(
    tokenizer: Tokenizer, turns: list[Turn], tools: list[FunctionDef], suffix: str = ""
) -> str:
    return template_text(lambda: tool_prompt.render(tokenizer, turns, tools, suffix), "messages")


def _cuts(marks: list[Breakpoint], turn: int) -> list[int]:
    return sorted({m.chars for m in marks if m.turn == turn})


def _insert_marks(content: str, cuts: list[int]) -> str:
    pieces, start = [], 0
    for cut in cuts:
        pieces += [content[start:cut], MARK]
        start = cut
    return "".join(pieces) + content[start:]


def _searched_ends(text: str, turns: list[Turn], marks: list[Breakpoint]) -> list[int]:
    """Breakpoints found by searching each turn's content, in order, as written or
    stripped (templates that trim content); the breakpoints of a turn not found retain
    nothing."""
    found: list[tuple[int, int, int] | None] = []  # start, characters stripped, length
    cursor = 0
    for turn in turns:
        stripped = turn.content.strip()
        lead = len(turn.content) - len(turn.content.lstrip())
        at = text.find(turn.content, cursor) if turn.content else -1
        where = (at, 0, len(turn.content)) if at >= 0 else None
        if where is None and stripped:
            at = text.find(stripped, cursor)
            where = (at, lead, len(stripped)) if at >= 0 else None
        found.append(where)
        cursor = where[0] + where[2] if where else cursor
    ends = []
    for mark in marks:
        where = found[mark.turn] if mark.turn != TOOLS else None
        inside = None if where is None else min(max(mark.chars - where[1], 0), where[2])
        ends.append(0 if where is None else where[0] + inside)
    return ends


def tokens_before(token_ends: list[int], chars: int) -> int:
    """How many leading tokens end at or before character ``chars``."""
    count = 0
    for end in token_ends:
        if end > chars:
            break
        count += 1
    return count


def _sampling(body: MessagesRequest, constraint: Constraint | None) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            stop=body.stop_sequences,
            constraint=constraint,
        )
    except ValueError as error:
        raise ApiError(400, str(error), str(error).split(" ", 1)[0]) from None
