"""``prefixcache explain --window W``: what B reuses when the model's sliding-window layers keep
only their window (issue 35, docs/design.md rule 11).

A is replayed through a manager with a full group and a window group of W tokens: its prompt,
then its last ``--answer-tokens`` decoded one by one. B is matched twice: while A's stale
window pages are still in the pool (no memory pressure), and once they are evicted through
the pool (under pressure only the kept windows, at the end of A's prompt and of its answer,
survive). A second hit shorter than the full layers' is a window-caused miss, and the report
says what each group held.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from prefixcache.cache import KVCacheManager, Namespace
from prefixcache.cache.blocks import Block
from prefixcache.cache.common import cdiv
from prefixcache.cache.groups import KVGroupSpec

if TYPE_CHECKING:
    from prefixcache.tools.explain import Side

Span = tuple[int, int]  # token positions [start, end)


@dataclass(frozen=True, slots=True)
class WindowReuse:
    """B's hit in a pool whose window layers keep only ``window`` tokens."""

    window: int
    full: int  # tokens the full layers hold for B (the hit without window groups)
    unpressed: int  # B's hit while A's stale window pages are still cached
    pressed: int  # B's hit once they are evicted: only the kept windows serve it
    held: list[Span]  # the spans of A whose window pages survive the pressure


def measure_window_reuse(
    a: Side, b: Side, namespace: Namespace, window: int, answer_tokens: int, full: int
) -> WindowReuse:
    """Replay A (prompt, then ``answer_tokens`` decoded), match B, evict the stale window
    pages, match B again; ``full`` is B's hit in an all-full pool (0: nothing to replay)."""
    if not full:
        return WindowReuse(window, 0, 0, 0, [])
    manager = _hybrid_manager(a, namespace, window)
    blocks = _replay(manager, a, answer_tokens)
    keys = (b.spec.cache_salt, b.spec.lora_name)
    unpressed = manager.match(b.tokens, *keys)
    _evict_stale_pages(manager)
    pressed = manager.match(b.tokens, *keys)
    manager.check_invariants()
    return WindowReuse(window, full, unpressed, pressed, _held_spans(manager, blocks))


def _hybrid_manager(a: Side, namespace: Namespace, window: int) -> KVCacheManager:
    """A pool with a page per group for every block of A: nothing is evicted while A runs."""
    return KVCacheManager(
        2 * cdiv(len(a.tokens), namespace.block_size),
        namespace.block_size,
        namespace=namespace,
        groups=(KVGroupSpec(1), KVGroupSpec(1, window)),
    )


def _replay(manager: KVCacheManager, a: Side, answer_tokens: int) -> list[Block]:
    """A's prompt computed at once, its answer a token a step, then freed; A's blocks."""
    prompt = len(a.tokens) - answer_tokens
    seq = manager.admit("A", a.tokens[:prompt], a.spec.cache_salt, a.spec.lora_name)
    assert seq is not None, "the pool holds every block of A"
    manager.commit(seq, prompt)
    for token in a.tokens[prompt:]:
        assert manager.append(seq, [token]), "the pool holds every block of A"
        manager.commit(seq, seq.num_tokens)
    blocks = list(seq.blocks)
    manager.free(seq)
    return blocks


def _evict_stale_pages(manager: KVCacheManager) -> None:
    """Memory pressure: take every empty block and stale window page (the pool gives those
    first), then give them back empty; the kept windows and every full block stay."""
    pool, windows = manager.pool, manager.windows
    assert windows is not None
    taken = pool.allocate(pool.empty_queue.size + windows.stale.size)
    pool.release(taken)
    assert not windows.stale.size


def _held_spans(manager: KVCacheManager, blocks: list[Block]) -> list[Span]:
    """Runs of A's cached blocks that still have their window page, as token spans."""
    windows, size = manager.windows, manager.block_size
    assert windows is not None
    spans: list[Span] = []
    for index, block in enumerate(blocks):
        if block.key is None or windows.page(block, 0) is None:
            continue
        if spans and spans[-1][1] == index * size:
            spans[-1] = (spans[-1][0], (index + 1) * size)
        else:
            spans.append((index * size, (index + 1) * size))
    return spans


def window_lines(reuse: WindowReuse, num_tokens: int) -> list[str]:
    """The report's window part: both hits, then the window-caused miss if there is one."""
    head = f"window layers ({reuse.window:,} tokens; A replayed with a full and a window group):"
    if not reuse.full:
        return [f"{head} nothing to lose: the full layers hold nothing of B"]
    held = ", ".join(f"{start:,}-{end - 1:,}" for start, end in reuse.held) or "none"
    lines = [
        head,
        f"  no memory pressure (A's stale window pages still cached): B reuses "
        f"{reuse.unpressed:,} tokens",
        f"  under memory pressure (stale window pages evicted; window pages kept for tokens "
        f"{held}): B reuses {reuse.pressed:,} tokens",
    ]
    if reuse.pressed >= reuse.full:
        return lines + [
            f"window-caused miss: none: the kept windows serve B's whole {reuse.full:,}-token hit"
        ]
    return lines + [_miss_line(reuse, num_tokens)]


def _window_before(end: int, window: int) -> str:
    """The tokens a query at ``end`` reads in a window layer, besides itself."""
    return f"the window before {end:,} (tokens {max(0, end - window + 1):,}-{end - 1:,})"


def _miss_line(reuse: WindowReuse, num_tokens: int) -> str:
    """Name the miss: what the full layers held, which window the window layers held, and
    what is recomputed."""
    full, hit, window = reuse.full, reuse.pressed, reuse.window
    if hit:
        held = f"{_window_before(hit, window)}, not the one before {full:,}"
        after = f"only its {num_tokens - hit:,} tokens after {hit:,} are recomputed, not the whole"
    else:
        held = f"none of {_window_before(full, window)} nor of any earlier one"
        after = f"all {num_tokens:,} tokens are recomputed, the whole"
    return (
        f"window-caused miss: full layers held {full:,} tokens; window layers held {held}; "
        f"B reuses {hit:,} tokens under pressure: {after} prompt"
    )
