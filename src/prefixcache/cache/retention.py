"""Retention: cached blocks a client asked to keep (a class and an expiry per block).

A mark (``mark``) sits on a held, stored block: until when, which class ("5m", "1h") and
which owner (a tenant name) asked. It only ever extends an expiry. When a marked block is
released with its mark unexpired, it waits here (``free``) instead of in the eviction
policy; a hit takes it back out (``claim``), and a later release puts it back while the mark
lasts. The pool sweeps expired ones back into their owner's policy before each allocation
(``pop_expired``) and takes the rest, earliest expiry first (``pop_earliest``), only when
nothing else is free. A mark ends when it expires, when its block is evicted (the content
is gone) or on ``clear`` (``reset``).

Each owner's unexpired marks (held or free) stay within ``share * num_blocks``; marks past
that are refused and counted, never an error. Owners are names, independent of the fair
pool's ``Owners`` (a retention request never registers a tenant there or moves its share).
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

from prefixcache.cache.blocks import Block
from prefixcache.cache.stats import CacheStats

NO_MARK = -math.inf  # the expiry of a block nobody retains
DEFAULT_SHARE = 0.5  # of the pool, per owner, unless its name is listed


class Keep(NamedTuple):
    """A client's ask: keep the prompt's first ``num_tokens`` cached ``ttl_seconds`` more."""

    num_tokens: int
    ttl_seconds: float
    retention_class: str = "5m"


def check_share(name: str, share: object) -> float:
    """A retention share is a number in [0, 1]; ValueError naming the owner otherwise."""
    valid = isinstance(share, (int, float)) and not isinstance(share, bool)
    if not valid or not math.isfinite(share) or not 0 <= share <= 1:
        raise ValueError(f"retention budget of {name} must be a number in [0, 1], got {share!r}")
    return float(share)


def check_budgets(default: object, budgets: Mapping[str, float]) -> dict[str, float]:
    """The default share and each listed owner's share, checked."""
    check_share("every owner", default)
    if not isinstance(budgets, Mapping):
        raise ValueError(f"retention_budgets must be a dict of owner -> share, got {budgets!r}")
    return {name: check_share(repr(name), share) for name, share in budgets.items()}


class Retention:
    """Per-block marks (expiry, class, owner) and the free retained blocks, by expiry.

    ``heap`` holds ``(expiry, stamp, block id)`` per entry into ``free``; an entry is live
    only while its block is free here with that stamp (lazy deletion).
    """

    __slots__ = (
        "clock",
        "stats",
        "num_blocks",
        "default_share",
        "shares",
        "expiry",
        "klass",
        "marked_by",
        "releaser",
        "stamp",
        "marks",
        "free",
        "heap",
        "_next_stamp",
    )

    def __init__(
        self,
        num_blocks: int,
        stats: CacheStats,
        clock: Callable[[], float] = time.monotonic,
        default_share: float = DEFAULT_SHARE,
        shares: Mapping[str, float] | None = None,
    ) -> None:
        self.clock = clock
        self.stats = stats
        self.num_blocks = num_blocks
        self.shares = check_budgets(default_share, shares or {})
        self.default_share = float(default_share)
        self.expiry = [NO_MARK] * num_blocks
        self.klass: list[str | None] = [None] * num_blocks
        self.marked_by: list[str | None] = [None] * num_blocks
        self.releaser = [0] * num_blocks  # the pool owner id whose release made it free
        self.stamp = [0] * num_blocks
        self.marks: dict[str | None, set[int]] = {}  # owner -> block ids it marked
        self.free: dict[int, Block] = {}  # free retained blocks
        self.heap: list[tuple[float, int, int]] = []
        self._next_stamp = 0

    # ------------------------------------------------------------------ marks
    def budget(self, owner: str | None) -> int:
        """How many unexpired marks ``owner`` may hold at once."""
        return int(self.shares.get(owner, self.default_share) * self.num_blocks)

    def unexpired(self, owner: str | None, now: float) -> int:
        """``owner``'s marks (held or free) that have not expired at ``now``."""
        expiry = self.expiry
        return sum(1 for block_id in self.marks.get(owner, ()) if expiry[block_id] > now)

    def mark(self, blocks: Iterable[Block], ttl: float, klass: str, owner: str | None) -> int:
        """Retain held ``blocks`` for ``ttl`` seconds more; how many are retained that long.

        A block already retained as long stays as it is; a longer mark moves to ``owner``
        if its budget allows, else it is refused (counted in ``stats.retention_refused``).
        """
        now = self.clock()
        until = now + ttl
        room = self.budget(owner) - self.unexpired(owner, now)
        retained = refused = 0
        for block in blocks:
            block_id = block.block_id
            current = self.expiry[block_id]
            if current >= until:
                retained += 1
                continue
            ours = current > now and self.marked_by[block_id] == owner
            if not ours and room <= 0:
                refused += 1
                continue
            if not ours:
                room -= 1
            self._set(block_id, until, klass, owner)
            retained += 1
        self.stats.retention_refused += refused
        return retained

    def _set(self, block_id: int, until: float, klass: str, owner: str | None) -> None:
        if self.expiry[block_id] != NO_MARK:
            self.unmark(block_id)
        self.expiry[block_id] = until
        self.klass[block_id] = klass
        self.marked_by[block_id] = owner
        self.marks.setdefault(owner, set()).add(block_id)

    def unmark(self, block_id: int) -> None:
        """Drop the block's mark (expired, evicted or cleared)."""
        owner = self.marked_by[block_id]
        owned = self.marks[owner]
        owned.discard(block_id)
        if not owned:
            del self.marks[owner]
        self.expiry[block_id] = NO_MARK
        self.klass[block_id] = self.marked_by[block_id] = None

    def retained_blocks(self) -> int:
        """Blocks marked and unexpired now, held or free (a gauge)."""
        now, expiry = self.clock(), self.expiry
        return sum(1 for owned in self.marks.values() for b in owned if expiry[b] > now)

    def usage(self) -> dict[tuple[str | None, str], int]:
        """Unexpired marks now, by (owner, class): held or free (a gauge)."""
        now, expiry, klass = self.clock(), self.expiry, self.klass
        counts: dict[tuple[str | None, str], int] = {}
        for owner, owned in self.marks.items():
            for block_id in owned:
                if expiry[block_id] > now:
                    key = (owner, klass[block_id])
                    counts[key] = counts.get(key, 0) + 1
        return counts

    # ------------------------------------------------------------ the pool's events
    def hold(self, cached: list[Block], empties: list[Block], releaser: int) -> list[Block]:
        """Blocks just released: keep the unexpired marked cached ones; return the rest of
        ``cached`` (in order) for the policy. Emptied blocks lose their marks."""
        expiry = self.expiry
        for block in empties:
            if expiry[block.block_id] != NO_MARK:
                self.unmark(block.block_id)
        now = self.clock()
        rest = []
        for block in cached:
            block_id = block.block_id
            if expiry[block_id] > now:
                self._enter(block, releaser)
            else:
                if expiry[block_id] != NO_MARK:
                    self.unmark(block_id)
                    self.stats.retention_expired += 1
                rest.append(block)
        return rest

    def _enter(self, block: Block, releaser: int) -> None:
        block_id = block.block_id
        self.free[block_id] = block
        self.releaser[block_id] = releaser
        self._next_stamp += 1
        self.stamp[block_id] = self._next_stamp
        heapq.heappush(self.heap, (self.expiry[block_id], self._next_stamp, block_id))
        if len(self.heap) > 2 * len(self.free) + 64:
            self._compact()

    def _compact(self) -> None:
        """Rebuild the heap from the live entries only."""
        expiry, stamp = self.expiry, self.stamp
        self.heap = [(expiry[b], stamp[b], b) for b in self.free]
        heapq.heapify(self.heap)

    def claim(self, blocks: list[Block]) -> list[Block]:
        """Hits: free retained ones leave (counted as saved hits while unexpired); returns
        the others, for the policy. Their marks stay for their next release."""
        free, rest = self.free, []
        now = None
        for block in blocks:
            if free.pop(block.block_id, None) is None:
                rest.append(block)
                continue
            now = self.clock() if now is None else now
            if self.expiry[block.block_id] > now:
                self.stats.retention_saved_hits += 1
        return rest

    def pop_expired(self) -> list[Block]:
        """Free retained blocks whose marks expired, earliest first, unmarked."""
        now, heap, expired = self.clock(), self.heap, []
        while heap and heap[0][0] <= now:
            _, stamp, block_id = heapq.heappop(heap)
            if self._live(block_id, stamp):
                expired.append(self.free.pop(block_id))
                self.unmark(block_id)
        self.stats.retention_expired += len(expired)
        return expired

    def pop_earliest(self) -> Block:
        """The free retained block expiring first, unmarked: evicted before its expiry."""
        heap = self.heap
        while True:
            _, stamp, block_id = heapq.heappop(heap)
            if self._live(block_id, stamp):
                self.unmark(block_id)
                self.stats.retention_evictions += 1
                return self.free.pop(block_id)

    def _live(self, block_id: int, stamp: int) -> bool:
        return block_id in self.free and self.stamp[block_id] == stamp

    def last_resort(self, hits: set[int]) -> list[int]:
        """Releasers of the free retained blocks (but ``hits``), in ``pop_earliest`` order."""
        expiry, stamp = self.expiry, self.stamp
        order = sorted((expiry[b], stamp[b], b) for b in self.free if b not in hits)
        return [self.releaser[b] for _, _, b in order]

    def clear(self) -> list[Block]:
        """``reset``: every mark dropped; returns the free retained blocks."""
        blocks = list(self.free.values())
        for owned in list(self.marks.values()):
            for block_id in list(owned):
                self.unmark(block_id)
        self.free.clear()
        self.heap.clear()
        return blocks
