"""KV cache groups (issue 35): the longest hit every group serves, against brute force."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixcache.cache.groups import KVGroupSpec, check_groups, longest_hit

BLOCK = 4


def brute_force(groups: list[KVGroupSpec], held: list[list[bool]]) -> int:
    """Every L from the longest down, each group's condition written out plainly."""
    size = min(len(row) for row in held)
    for end in range(size, -1, -1):
        fits = True
        for group, row in zip(groups, held, strict=True):
            first = 0 if group.window is None else max(0, end * BLOCK - group.window + 1)
            fits &= all(row[first // BLOCK : end])
        if fits:
            return end
    raise AssertionError("L = 0 always fits")


@st.composite
def layouts(draw):
    windows = draw(st.lists(st.one_of(st.none(), st.integers(1, 40)), min_size=1, max_size=4))
    size = draw(st.integers(0, 24))
    groups = [KVGroupSpec(2, window) for window in windows]
    held = [draw(st.lists(st.booleans(), min_size=size, max_size=size)) for _ in groups]
    return groups, held


@given(layouts())
def test_the_longest_hit_is_the_largest_every_group_serves(layout) -> None:
    groups, held = layout
    assert longest_hit(groups, held, BLOCK) == brute_force(groups, held)


def test_gemma_like_groups_recompute_only_what_the_window_lacks() -> None:
    """Full layers hold 40 blocks of 16; the window group (512 tokens) released everything
    before block 8: the last 32 blocks before L = 40 are all it needs, so all 40 are a hit.
    A gap at block 30 moves the hit back to the last L whose window is whole, not to 0."""
    full, window = KVGroupSpec(3), KVGroupSpec(3, window=512)
    assert window.blocks_needed(16) == 32  # 511 tokens before the first new one
    held_full = [True] * 40
    held_window = [False] * 8 + [True] * 32
    assert longest_hit([full, window], [held_full, held_window], 16) == 40
    kept_all = [True] * 40
    kept_all[30] = False  # one window block evicted
    assert longest_hit([full, window], [held_full, kept_all], 16) == 30
    held_window[30] = False  # released before block 8 and a gap: no whole window before L
    assert longest_hit([full, window], [held_full, held_window], 16) == 0


def test_groups_must_share_one_page_size() -> None:
    with pytest.raises(ValueError, match="equal layer counts"):
        check_groups([KVGroupSpec(3), KVGroupSpec(15, window=512)])
    with pytest.raises(ValueError, match="at least one layer"):
        KVGroupSpec(0)
    with pytest.raises(ValueError, match="sliding window"):
        KVGroupSpec(3, window=0)
