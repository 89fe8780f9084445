"""Window groups' pages: each logical block's page per sliding-window group, from the one pool.

A logical block (a ``Block`` of the pool, its identity and the full group's page) may carry
one page per window group. A running sequence holds the pages its windows still read; the
rest go back to the pool at once, still attached and matchable, as free pages in one of
two queues: ``stale`` (out of a window mid-run: evicted before anything else) and ``kept``
(the windows a follow-up needs: the end of a prompt and of an answer; evicted only when
nothing else is free, or with their logical block). Evicting a page leaves its logical
block in place without it (a tombstone, in SGLang's words), so a full-group hit survives
and only the window groups' part is recomputed. While KV events are on, a ``reporter``
hears of pages attached to or detached from an indexed logical block. Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prefixcache.cache.blocks import Block, FreeBlockQueue
from prefixcache.cache.common import cdiv, require
from prefixcache.cache.groups import KVGroupSpec, longest_hit
from prefixcache.cache.sequence import NO_PAGE, Sequence
from prefixcache.cache.stats import CacheStats

if TYPE_CHECKING:
    from prefixcache.cache.events import WindowReporter

Rows = list[list[Block | None]]  # per window group, a page (or None) per block of a sequence


class WindowPages:
    """The attachment of window pages to logical blocks, and the two free-page queues."""

    def __init__(
        self, windows: list[int], block_size: int, stats: CacheStats, empty: FreeBlockQueue
    ) -> None:
        self.windows = windows  # tokens per window group (group g + 1 of the model)
        self.block_size = block_size
        self.stats = stats
        self.empty = empty  # the pool's empty queue: detached pages go to its head
        self.specs = [KVGroupSpec(1)] + [KVGroupSpec(1, window) for window in windows]
        self.attached: dict[int, list[Block | None]] = {}  # logical id -> page per group
        self.home: dict[int, tuple[Block, int]] = {}  # page id -> (logical block, group)
        self.stale = FreeBlockQueue([])
        self.kept = FreeBlockQueue([])
        self.in_kept: set[int] = set()
        self.twins: dict[int, Block] = {}  # duplicate's id -> the indexed copy (``adopt``)
        self.counts = [0] * len(windows)  # pages attached now, per window group
        self.reporter: WindowReporter | None = None  # KV events of indexed blocks' pages

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def __len__(self) -> int:
        """Free pages still attached (both queues)."""
        return self.stale.size + self.kept.size

    def bytes_per_cached_token(self, page_token_bytes: int, cached_blocks: int) -> list[float]:
        """Per window group, its attached pages' bytes over every cached token
        (``page_token_bytes``: one token in one page; 0.0 with nothing cached)."""
        tokens = cached_blocks * self.block_size
        return [page_token_bytes * n * self.block_size / tokens if tokens else 0.0
                for n in self.counts]  # fmt: skip

    def free_pages(self) -> Iterator[Block]:
        yield from self.stale
        yield from self.kept

    def needed_from(self, group: int, num_tokens: int) -> int:
        """First block index a query at position ``num_tokens`` reads in window ``group``."""
        return max(0, num_tokens - self.windows[group] + 1) // self.block_size

    def page(self, logical: Block, group: int) -> Block | None:
        pages = self.attached.get(logical.block_id)
        return None if pages is None else pages[group]

    def keeps_before(self, group: int) -> int:
        """Whole blocks before a hit's end that window ``group`` reads."""
        return cdiv(self.windows[group] - 1, self.block_size)

    # ---------------------------------------------------------------- prefix hits
    def longest_hit(self, hits: list[Block]) -> int:
        """Leading blocks of the full group's ``hits`` every window group can serve too."""
        held = [[True] * len(hits)]
        held += [[self.page(block, group) is not None for block in hits]
                 for group in range(self.num_groups)]  # fmt: skip
        return longest_hit(self.specs, held, self.block_size)

    def hit_rows(self, hits: list[Block]) -> Rows:
        """Per window group, the pages of ``hits`` its window reads (None before it)."""
        rows = []
        for group in range(self.num_groups):
            start = self.needed_from(group, len(hits) * self.block_size)
            rows.append([None] * start + [self.page(block, group) for block in hits[start:]])
        return rows

    def spare_stale(self, rows: Rows) -> int:
        """Stale pages an admission taking ``rows`` could still reuse before any eviction."""
        taken = sum(
            1
            for row in rows
            for page in row
            if page is not None and page.ref_cnt == 0 and page.block_id not in self.in_kept
        )
        return self.stale.size - taken

    # ------------------------------------------------------------- a sequence's pages
    def extend(
        self,
        rows: Rows,
        blocks: list[Block],
        pages: list[Block],
        tables: list[list[int]] | None = None,
    ) -> None:
        """New ``blocks`` get fresh held ``pages`` (``len(blocks)`` per group, in order)."""
        count = len(blocks)
        for group, row in enumerate(rows):
            fresh = pages[group * count : (group + 1) * count]
            for block, page in zip(blocks, fresh, strict=True):
                self.attach(block, group, page)
            row += fresh
            if tables is not None:
                tables[group] += [page.block_id for page in fresh]

    def slide(self, seq: Sequence, first_query: int) -> None:
        """Give back the pages of ``seq`` no window reads from ``first_query`` on. Those a
        follow-up at the prompt's end needs are kept."""
        prompt_end = seq.num_prompt_tokens // self.block_size
        for group, row in enumerate(seq.window_pages):
            start = min(self.needed_from(group, first_query), len(row))
            first = seq.window_from[group]
            if start <= first:
                continue
            keep_from = prompt_end - self.keeps_before(group)
            table = seq.window_tables[group]
            for index in range(first, start):
                page = row[index]
                if page is not None:
                    row[index], table[index] = None, NO_PAGE
                    self._give_back(page, keep_from <= index < prompt_end)
            seq.window_from[group] = start

    def loaded_from(self, group: int, end_block: int) -> int:
        """First block whose page window ``group`` needs after a load that ends at
        ``end_block``: what a second tier must supply for it."""
        return self.needed_from(group, end_block * self.block_size)

    def drop_unloaded(self, seq: Sequence, first: int, end: int) -> None:
        """Blocks [first, end) of ``seq`` were loaded from a second tier, each window group
        only from ``loaded_from``: its new pages before that hold nothing and go back empty
        (never matchable)."""
        for group, row in enumerate(seq.window_pages):
            for index in range(first, min(end, self.loaded_from(group, end))):
                page = row[index]
                if page is not None:
                    row[index], seq.window_tables[group][index] = None, NO_PAGE
                    logical, _ = self.home[page.block_id]
                    require(logical.key is None, f"window: loading into stored {logical}")
                    self._give_back(page, False)

    def release_all(self, seq: Sequence) -> None:
        """``seq`` is freed: its pages (the window at its end) are kept."""
        for row in seq.window_pages:
            for page in row:
                if page is not None:
                    self._give_back(page, True)
        seq.window_pages, seq.window_tables = [], []

    def replace_last(self, seq: Sequence, copy: Block, pages: list[Block]) -> list[tuple[int, int]]:
        """Copy-on-write of a shared partial last block: ``copy`` gets ``pages``; the
        (source, destination) page ids to copy."""
        pairs = []
        for group, (row, page) in enumerate(zip(seq.window_pages, pages, strict=True)):
            shared = row[-1]
            assert shared is not None, "the last block is always in the window"
            self.attach(copy, group, page)
            row[-1] = page
            seq.window_tables[group][-1] = page.block_id
            self._give_back(shared, False)
            pairs.append((shared.block_id, page.block_id))
        return pairs

    def _give_back(self, page: Block, keep: bool) -> None:
        detached = self.release(page, keep)
        if detached is not None:
            self.empty.appendleft(detached)

    # ------------------------------------------------------------------ holding
    def attach(self, logical: Block, group: int, page: Block) -> None:
        """``page`` (held) now holds ``logical``'s KV for window ``group``."""
        pages = self.attached.setdefault(logical.block_id, [None] * self.num_groups)
        require(pages[group] is None, f"window: {logical} already has a page in group {group}")
        pages[group] = page
        self.home[page.block_id] = (logical, group)
        self.counts[group] += 1
        if self.reporter is not None and logical.key is not None:
            self.reporter.attached(logical, group)  # an adopted page

    def acquire(self, pages: list[Block]) -> None:
        """A reference on each attached page (a hit in a window, a fork)."""
        for page in pages:
            if page.ref_cnt == 0:
                self._unlink(page)
            page.ref_cnt += 1

    def release(self, page: Block, keep: bool) -> Block | None:
        """Drop a reference; at 0 the page waits in ``kept`` (``keep``) or ``stale`` while its
        logical block (or, for a duplicate, the indexed copy) can be matched; otherwise it is
        detached and returned for the empty queue."""
        page.ref_cnt -= 1
        if page.ref_cnt:
            return None
        logical, group = self.home[page.block_id]
        if logical.key is None:  # unstored, a duplicate, caching off: nobody can match it
            twin = self.twins.get(logical.block_id)
            self.detach(page)
            if not self._wanted_by(twin, logical, group):
                return page
            assert twin is not None
            self.attach(twin, group, page)  # the recomputed window is not lost
        if keep:
            self.kept.append(page)
            self.in_kept.add(page.block_id)
        else:
            self.stale.append(page)
        self.stats.window_pages_released += 1
        return None

    def adopt(self, indexed: Block, duplicate: Block) -> None:
        """``duplicate`` was committed as a copy of ``indexed``: as its pages are released,
        each goes to the indexed copy if that lacks one (a window-caused recompute)."""
        if duplicate.block_id in self.attached:
            self.twins[duplicate.block_id] = indexed

    def _wanted_by(self, twin: Block | None, duplicate: Block, group: int) -> bool:
        """Whether ``twin`` is still the indexed copy of ``duplicate`` and lacks ``group``."""
        return (
            twin is not None
            and twin.key is not None
            and twin.uid == duplicate.uid
            and self.page(twin, group) is None
        )

    # ----------------------------------------------------------------- eviction
    def pop(self, queue: FreeBlockQueue) -> Block:
        """The next free page of ``queue``, detached from its logical block (a tombstone)."""
        page = queue.popleft()
        self.in_kept.discard(page.block_id)
        self.detach(page)
        self.stats.window_pages_evicted += 1
        return page

    def drop_all(self, logical: Block) -> list[Block]:
        """``logical`` loses its identity (evicted): its free pages, detached, for the empty
        queue. No page can be held while its logical block is free."""
        pages = self.attached.pop(logical.block_id, None)
        self.twins.pop(logical.block_id, None)
        if pages is None:
            return []
        dropped = []
        for group, page in enumerate(pages):
            if page is not None:
                require(page.ref_cnt == 0, f"window: {page} held while its {logical} is evicted")
                self._unlink(page)
                del self.home[page.block_id]
                self.counts[group] -= 1
                dropped.append(page)
                if self.reporter is not None and logical.key is not None:
                    self.reporter.detached(logical, group)
        return dropped

    def detach(self, page: Block) -> None:
        """Forget which logical block ``page`` served."""
        logical, group = self.home.pop(page.block_id)
        pages = self.attached[logical.block_id]
        pages[group] = None
        self.counts[group] -= 1
        if self.reporter is not None and logical.key is not None:
            self.reporter.detached(logical, group)  # a tombstone
        if not any(pages):
            del self.attached[logical.block_id]
            self.twins.pop(logical.block_id, None)

    def clear(self) -> list[Block]:
        """Every free page, detached (only valid while no page is held)."""
        pages = list(self.free_pages())
        self.stale, self.kept = FreeBlockQueue([]), FreeBlockQueue([])
        self.in_kept.clear()
        self.attached.clear()
        self.home.clear()
        self.twins.clear()
        self.counts = [0] * self.num_groups
        return pages

    def _unlink(self, page: Block) -> None:
        """Take a free page out of whichever queue holds it."""
        if page.block_id in self.in_kept:
            self.in_kept.discard(page.block_id)
            self.kept.remove(page)
        else:
            self.stale.remove(page)
