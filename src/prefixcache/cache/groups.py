"""KV cache groups (issue 35): which layers share a block table, and the longest prefix hit
every group can serve.

A model declares its groups: *full* attention groups need KV for every token before the
first new one; a *window* group of W tokens needs only the last W. With one page size for
all (layers per group equal, as vLLM's hybrid manager requires), a hit of L tokens (L on a
block boundary) is usable when every full group holds blocks ``[0, L/bs)`` and every window
group holds the blocks covering ``[L - W + 1, L)``: a window group may have released (or
evicted) what lies before. Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prefixcache.cache.common import cdiv


@dataclass(frozen=True, slots=True)
class KVGroupSpec:
    """One group of layers: full attention (``window`` None) or a sliding window of tokens."""

    num_layers: int
    window: int | None = None

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"a KV group needs at least one layer, not {self.num_layers}")
        if self.window is not None and self.window < 1:
            raise ValueError(f"a sliding window must be >= 1 token, not {self.window}")

    def blocks_needed(self, block_size: int) -> int | None:
        """Blocks before the first new token this group reads (None: all of them).

        A token at position p reads ``[p - W + 1, p]``; the first new token sits at L, so the
        blocks holding ``[L - W + 1, L)``: at most ``cdiv(W - 1, block_size)`` whole blocks
        when L is on a block boundary."""
        return None if self.window is None else cdiv(self.window - 1, block_size)


def check_groups(groups: Sequence[KVGroupSpec]) -> None:
    """ValueError unless there is a group and every group has the same number of layers (one
    page size for the pool)."""
    if not groups:
        raise ValueError("a model needs at least one KV group")
    layers = {group.num_layers for group in groups}
    if len(layers) != 1:
        raise ValueError(f"KV groups must have equal layer counts (one page size), not {layers}")


def longest_hit(
    groups: Sequence[KVGroupSpec], held: Sequence[Sequence[bool]], block_size: int
) -> int:
    """The most leading blocks L every group can serve: a full group holds blocks
    ``[0, L)``, a window group the last ``blocks_needed`` of them. ``held[g][i]``: group g
    holds block i of the prompt now. O(groups x blocks): one pass per group, one scan."""
    check_groups(groups)
    if len(held) != len(groups):
        raise ValueError(f"held has {len(held)} rows for {len(groups)} groups")
    size = min((len(row) for row in held), default=0)
    usable = [_usable_ends(row, size, group.blocks_needed(block_size)) for group, row in
              zip(groups, held, strict=True)]  # fmt: skip
    return next(end for end in range(size, -1, -1) if all(ok[end] for ok in usable))


def _usable_ends(row: Sequence[bool], size: int, need: int | None) -> list[bool]:
    """``ok[L]`` for L in 0..size: this group alone could serve a hit of L blocks."""
    ok, run = [True], 0  # a hit of nothing needs nothing
    for end in range(1, size + 1):
        run = run + 1 if row[end - 1] else 0  # held blocks ending at block end-1
        wanted = end if need is None else min(end, need)
        ok.append(run >= wanted if need is not None else ok[-1] and row[end - 1])
    return ok


def window_sizes(groups: Sequence[KVGroupSpec]) -> list[int]:
    """The windows of a manager's groups: a full group first, then window groups only
    (() or one full group: an all-full pool). ValueError names what does not fit."""
    if not groups:
        return []
    check_groups(groups)
    if groups[0].window is not None:
        raise ValueError("the first KV group must be full attention (the blocks' identity)")
    windows = [group.window for group in groups[1:]]
    if None in windows:
        raise ValueError("only the first KV group may be full attention")
    return [window for window in windows if window is not None]
