"""``POST /v1/responses`` prepared: input items to turns, the stored conversation before them.

Runs on a prepare thread (it reads the tenant's stored responses). The prompt is rendered
like a chat's: ``instructions`` as the system message, then the previous response's
conversation and output, then ``input``; tools as for chat.
"""

from __future__ import annotations

from typing import Any

from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.protocol.errors import ApiError
from prefixcache.protocol.responses_schemas import ResponsesRequest
from prefixcache.protocol.tool_prompt import Call, Turn
from prefixcache.protocol.tool_schemas import check_arguments
from prefixcache.server.prepare import (
    PrepareContext,
    Prepared,
    compiled,
    parse_body,
    render_prompt,
    tool_rules,
)
from prefixcache.server.response_store import TenantResponses
from prefixcache.server.responses_format import ResponsesShape, input_items

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")


def prepare_responses(raw: bytes, ctx: PrepareContext, view: TenantResponses) -> Prepared:
    """A Responses body as one engine request, its shape saving to ``view`` when done."""
    body: ResponsesRequest = parse_body(raw, ResponsesRequest, ctx)  # type: ignore[assignment]
    rules = tool_rules(body.tools, body.tool_choice, body.parallel_tool_calls, "tool_choice")
    history: list[Turn] = []
    if body.previous_response_id is not None:
        stored = view.get(body.previous_response_id)
        if stored is None:
            message = f"previous_response_id {body.previous_response_id!r} was not found"
            raise ApiError(404, message, "previous_response_id")
        history = list(stored.turns)
    new = input_turns(body.input, {c.id for t in history for c in t.calls})
    system = [Turn("system", body.instructions)] if body.instructions else []
    prompt = render_prompt(ctx, system + history + new, body.tools, "input")
    room = ctx.context - len(prompt)
    limit = body.max_output_tokens
    if limit is not None and limit > room:
        message = f"this model's context is {ctx.context} tokens; the input has {len(prompt)}"
        raise ApiError(400, f"{message} and max_output_tokens is {limit}", "max_output_tokens")
    params = SamplingParams(
        max_tokens=limit or room,
        temperature=body.temperature,
        top_p=body.top_p,
        constraint=compiled(rules.constraint, ctx, "tools"),
    )
    shape = ResponsesShape(
        view.new_id(),
        body.model,
        history + new,
        _echo(body),
        rules.names,
        view.put if body.store else None,
        input_items(body.input) if body.store else [],
        ctx.tokenizer,
    )
    return Prepared(body, [prompt], params, shape)  # type: ignore[arg-type]


def _echo(body: ResponsesRequest) -> dict:
    return {
        "instructions": body.instructions,
        "tools": [t.model_dump(exclude_none=True) for t in body.tools],
        "tool_choice": body.tool_choice or ("auto" if body.tools else "none"),
        "parallel_tool_calls": body.parallel_tool_calls,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "max_output_tokens": body.max_output_tokens,
        "previous_response_id": body.previous_response_id,
        "store": body.store,
        "user": body.user,
    }


def input_turns(value: str | list, known: set[str]) -> list[Turn]:
    """``input`` as turns; a function_call joins the assistant turn just before it, and a
    function_call_output must answer a call before it (``known``: the stored ones)."""
    if isinstance(value, str):
        return [Turn("user", value)]
    turns: list[Turn] = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise _bad(i, "", "must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            turns.append(Turn(_role(i, item), _text(i, item.get("content"))))
        elif kind == "function_call":
            call = Call(_string(i, item, "call_id"), _string(i, item, "name"), _arguments(i, item))
            known.add(call.id)
            if not turns or turns[-1].role != "assistant":
                turns.append(Turn("assistant"))
            turns[-1].calls.append(call)
        elif kind == "function_call_output":
            call_id = _string(i, item, "call_id")
            if call_id not in known:
                raise _bad(i, "call_id", "answers no function_call before it")
            turns.append(Turn("tool", _output(i, item), call_id=call_id))
        else:
            raise _bad(i, "type", f"{str(kind)[:40]!r} is not message, function_call or "
                       "function_call_output")  # fmt: skip
    return turns


def _bad(index: int, key: str, message: str) -> ApiError:
    field = f"input.{index}.{key}" if key else f"input.{index}"
    return ApiError(400, f"{field}: {message}", field)


def _role(index: int, item: dict) -> str:
    role = item.get("role")
    if role not in ROLES:
        raise _bad(index, "role", f"must be one of {', '.join(ROLES)}")
    return role


def _text(index: int, content: Any) -> str:
    """A message's content: a string or a list of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(index, "content", "must be a string or a list of input_text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
            raise _bad(index, f"content.{j}", "only input_text and output_text parts are supported")
        if not isinstance(part.get("text"), str):
            raise _bad(index, f"content.{j}.text", "must be a string")
        texts.append(part["text"])
    return "".join(texts)


def _string(index: int, item: dict, key: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value or len(value) > 256:
        raise _bad(index, key, "must be a string of 1 to 256 characters")
    return value


def _arguments(index: int, item: dict) -> str:
    arguments = item.get("arguments")
    try:
        return check_arguments(arguments if isinstance(arguments, str) else "")
    except ValueError as error:
        raise _bad(index, "arguments", str(error)) from None


def _output(index: int, item: dict) -> str:
    output = item.get("output")
    if isinstance(output, list):  # output parts, as for a message
        return _text(index, output)
    if not isinstance(output, str):
        raise _bad(index, "output", "must be a string")
    return output
