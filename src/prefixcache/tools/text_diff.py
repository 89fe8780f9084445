"""Where two text requests part: tokenization, chat template or content (offsets, no text)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prefixcache.tools.explain import Side

FORMS = {
    "token_ids": "token ids",
    "prompt": "a plain prompt (tokenized with BOS)",
    "messages": "chat messages (rendered by the chat template)",
}


def text_notes(a: Side, b: Side, first: int, tokenizer) -> list[str]:
    """Notes on why the token ids differ at ``first`` when text was given; never the text."""
    if not (a.spec.is_text or b.spec.is_text):
        return []
    if a.spec.kind != b.spec.kind:
        return [
            f"note: A was given as {FORMS[a.spec.kind]} and B as {FORMS[b.spec.kind]}: they "
            "are not tokenized the same way, so their ids part early (a tokenization/template "
            "difference); send both in one form"
        ]
    if a.text == b.text:
        return ["note: A and B render to the same text yet tokenize differently"]
    char = common_prefix(a.text, b.text)
    notes = _message_notes(a, b, char, tokenizer) if a.spec.messages is not None else []
    notes.append(_boundary_note(a, b, first, char))
    return notes


def _boundary_note(a: Side, b: Side, first: int, char: int) -> str:
    """Whether token ``first`` straddles the first differing character, or precedes it."""
    where = "rendered conversation" if a.spec.messages is not None else "prompt"
    spans = [side.offsets[first] for side in (a, b)]
    if min(end for _, end in spans) <= char:  # one side's token lies wholly in equal text
        return (
            f"note: tokenization boundary: the {where} texts agree on their first {char} "
            f"characters, yet token {first} (from character {spans[0][0]}) differs: BPE "
            "merged the same characters differently because of what follows them"
        )
    start, end = spans[0]
    return (
        f"note: the {where} text differs from character {char}, inside token {first} "
        f"(characters {start}-{end} of A)"
    )


def _message_notes(a: Side, b: Side, char: int, tokenizer) -> list[str]:
    """Which message differs, and whether the template already differed before it."""
    ma, mb = a.spec.messages, b.spec.messages
    index = common_prefix(ma, mb)
    if index < min(len(ma), len(mb)):
        x, y = ma[index], mb[index]
        if x["role"] != y["role"]:
            what = f"messages[{index}].role differs ({x['role']!r} vs {y['role']!r})"
        else:
            at = common_prefix(x["content"], y["content"])
            what = f"messages[{index}].content differs from character {at}"
    elif len(ma) != len(mb):
        what = f"A has {len(ma)} messages, B has {len(mb)}"
    else:
        what = "the messages are identical"
    shared = tokenizer.apply_chat_template(ma[:index], add_generation_prompt=False) if index else ""
    if index and char < len(shared):
        return [
            f"note: {what}, but the rendered texts differ earlier, at character {char}, inside "
            f"the identical messages[0:{index}]: a chat template difference (the template "
            "renders the same messages differently depending on what follows)"
        ]
    return [f"note: {what}"]


def common_prefix(x: Sequence, y: Sequence) -> int:
    """Length of the longest common prefix of two sequences (strings, token lists)."""
    size = min(len(x), len(y))
    return next((i for i in range(size) if x[i] != y[i]), size)
