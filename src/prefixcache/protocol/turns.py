"""One conversation model for every API: turns of text, an assistant's calls, tool results.

Chat completions, the Responses API and Anthropic's Messages API all build these, and
``protocol/tool_prompt.py`` renders them, so the same conversation is the same prompt (and
the same cached blocks) whichever API it came in by.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Call:
    """One function call: its id, the function and its arguments (a JSON object's text)."""

    id: str
    name: str
    arguments: str


@dataclass(slots=True)
class Turn:
    """One message of a conversation, whichever API it came in by."""

    role: str  # system, developer, user, assistant, tool
    content: str = ""
    calls: list[Call] = field(default_factory=list)  # assistant
    call_id: str | None = None  # tool: the call it answers
