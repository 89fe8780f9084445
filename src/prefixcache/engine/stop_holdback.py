"""How much of a completion's text may be shown before it finishes: never a stop string.

Text that could still grow into a stop string is held back (at most the longest stop
string less one character) and released once it cannot; what is released is always a
prefix of the final text, so streamed and non-streamed outputs are the same bytes.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence


def releasable_length(text: str, stops: Sequence[str]) -> int:
    """Length of the prefix of ``text`` that no continuation can turn into a stop string."""
    held = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:size]):
                held = size
                break
    return len(text) - held


def released_tokens(text_ends: Sequence[int], released: int) -> int:
    """Tokens whose text lies wholly in the first ``released`` characters."""
    return bisect_right(text_ends, released)


def visible_tokens(text_ends: Sequence[int], final_length: int) -> int:
    """Tokens of a finished completion that contribute to its (possibly cut) text.

    A token counts if its text starts before the cut or ends at or before it, so a token
    that straddles the cut is in and every token wholly past it is out.
    """
    starts = [0, *text_ends[:-1]]
    return max(bisect_left(starts, final_length), bisect_right(text_ends, final_length))
