"""Conversations with tools rendered into a prompt, the same bytes every turn.

A template with a tool section (its text reads ``tools``) gets the tools and the calls in
transformers' shape. Any other template (the default model's) gets the generic format: a
system block that lists the functions as JSON and shows the exact call format
(``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the Hermes/Qwen tags small
instruct models saw most; the grammar makes the format certain), past calls written back
as that text, and tool results as user turns in ``<tool_response>`` tags. Everything is
rendered from the request alone, so turn N+1's prompt starts with turn N's.
"""

from __future__ import annotations

import json
from typing import Protocol

from prefixcache.protocol.constraints import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from prefixcache.protocol.errors import ApiError
from prefixcache.protocol.schemas import ChatMessage
from prefixcache.protocol.tool_schemas import FunctionDef
from prefixcache.protocol.turns import Call, Turn


class ChatTemplate(Protocol):
    """What rendering needs of a tokenizer (``engine/tokenizer.py``'s ``Tokenizer``)."""

    has_tool_section: bool

    def apply_chat_template(self, messages: list[dict], **options: object) -> str: ...


RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
SYSTEM_ROLES = ("system", "developer")


def call_text(call: Call) -> str:
    """A call as the generic format writes it (canonical: name first, JSON's own spacing)."""
    arguments = json.loads(call.arguments)
    body = json.dumps({"name": call.name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}{body}{TOOL_CALL_CLOSE}"


def tools_block(tools: list[FunctionDef]) -> str:
    """The generic system block: the functions as JSON and the exact call format."""
    listed = "\n".join(json.dumps(t.shown(), ensure_ascii=False, sort_keys=True) for t in tools)
    return (
        "You can call these functions, listed as JSON in <tools></tools> tags:\n"
        f"<tools>\n{listed}\n</tools>\n"
        "To call a function, write exactly this, one per call, and nothing else:\n"
        f'{TOOL_CALL_OPEN}{{"name": "FUNCTION_NAME", "arguments": {{...}}}}{TOOL_CALL_CLOSE}\n'
        "The arguments are a JSON object that matches the function's parameters. Results come "
        f"back in {RESPONSE_OPEN}{RESPONSE_CLOSE} tags. If no function fits, answer in text."
    )


def render(
    tokenizer: ChatTemplate, turns: list[Turn], tools: list[FunctionDef], tools_suffix: str = ""
) -> str:
    """The prompt text of ``turns`` with ``tools`` (a tool section if the template has one;
    ``tools_suffix`` follows the generic tools block: where a breakpoint on the tools is)."""
    if tools and tokenizer.has_tool_section:
        listed = [{"type": "function", "function": t.shown()} for t in tools]
        return tokenizer.apply_chat_template([_native(t) for t in turns], tools=listed)
    messages = [_generic(t) for t in turns]
    if tools:
        block = tools_block(tools) + tools_suffix
        if messages[0]["role"] in SYSTEM_ROLES:
            messages[0] = {**messages[0], "content": f"{block}\n\n{messages[0]['content']}"}
        else:
            messages.insert(0, {"role": "system", "content": block})
    return tokenizer.apply_chat_template(messages)


def _generic(turn: Turn) -> dict:
    if turn.role == "tool":
        return {"role": "user", "content": f"{RESPONSE_OPEN}\n{turn.content}\n{RESPONSE_CLOSE}"}
    calls = "\n".join(call_text(c) for c in turn.calls)
    return {"role": turn.role, "content": turn.content + calls}


def _native(turn: Turn) -> dict:
    """transformers' message shape: calls with parsed arguments, tool results by call id."""
    message: dict = {"role": turn.role, "content": turn.content}
    if turn.calls:
        message["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": json.loads(c.arguments)},
            }
            for c in turn.calls
        ]
    if turn.call_id is not None:
        message["tool_call_id"] = turn.call_id
    return message


def unanswerable(turns: list[Turn]) -> int | None:
    """Index of the first tool turn whose call id no earlier assistant call has; else None."""
    seen: set[str] = set()
    for i, turn in enumerate(turns):
        seen.update(c.id for c in turn.calls)
        if turn.role == "tool" and turn.call_id not in seen:
            return i
    return None


def chat_turns(messages: list[ChatMessage]) -> list[Turn]:
    """Chat messages as turns; 400 naming the field for tool calls outside an assistant's."""
    turns = []
    for index, message in enumerate(messages):
        if message.tool_calls and message.role != "assistant":
            field = f"messages.{index}.tool_calls"
            raise ApiError(400, f"{field}: only assistant messages make tool calls", field)
        calls = [
            Call(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []
        ]
        turns.append(Turn(message.role, message.text(), calls, message.tool_call_id))
    return turns
