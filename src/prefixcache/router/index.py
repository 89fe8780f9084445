"""The global index: block digest -> replicas that hold it, fed by the replicas' KV events.

Two kinds of holding. A pool block (medium ``cpu``, or anything not a tier) is in one
replica's memory. A tier block (``disk``, ``redis``) is in a second tier: a disk tier is a
replica's own, but a Redis tier is shared, so a block any replica wrote to Redis is
credited to every replica that reports a Redis tier.

Every replica's entries carry a generation. ``attach`` starts one (clearing the old),
``restart`` replaces it after an epoch change, ``detach`` drops the replica; an update with
a stale generation is ignored, so a feed that was stopped cannot resurrect old entries.

``expect`` credits a replica with the prompt it was just sent (its blocks are being
computed there) until events confirm them: without it, requests sharing a new document
sent together would each go where nothing is cached yet.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

TIER_MEDIA = frozenset({"disk", "redis"})
SHARED_TIER_MEDIA = frozenset({"redis"})


class Overlap(NamedTuple):
    """A prompt's leading blocks a replica holds: in its pool, then (after those) in a tier."""

    pool_blocks: int = 0
    tier_blocks: int = 0


class BlockCounts(NamedTuple):
    """How many digests the index credits to one replica, by kind."""

    pool: int
    tier: int
    expected: int


@dataclass(slots=True)
class Expectation:
    """Blocks credited to ``replica`` because a request was just sent there."""

    replica: str
    generation: int
    digests: tuple[bytes, ...]
    settled: bool = False


@dataclass(slots=True)
class _Holdings:
    """One replica's side of the index (the reverse map, for clearing in O(own))."""

    generation: int
    tier_medium: str | None
    pool: set[bytes] = field(default_factory=set)
    tier: set[bytes] = field(default_factory=set)
    expected: Counter[bytes] = field(default_factory=Counter)


class GlobalIndex:
    """Which replicas hold which digests; thread-safe (feeds write, the router reads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: dict[bytes, set[str]] = {}  # digest -> replicas with it in their pool
        self._tier: dict[bytes, dict[str, str]] = {}  # digest -> {reporting replica: medium}
        self._replicas: dict[str, _Holdings] = {}
        self._generations = itertools.count(1)
        self._settling: list[tuple[float, int, Expectation]] = []  # heap by deadline
        self._order = itertools.count()

    # -- membership --

    def attach(self, replica: str, tier_medium: str | None) -> int:
        """Start (or start over) ``replica`` with no entries; its new generation."""
        with self._lock:
            self._drop(replica)
            generation = next(self._generations)
            self._replicas[replica] = _Holdings(generation, tier_medium)
            return generation

    def restart(self, replica: str, generation: int) -> int | None:
        """Clear ``replica`` after an epoch change; None if ``generation`` is no longer current."""
        with self._lock:
            holdings = self._replicas.get(replica)
            if holdings is None or holdings.generation != generation:
                return None
            self._drop(replica)
            new = next(self._generations)
            self._replicas[replica] = _Holdings(new, holdings.tier_medium)
            return new

    def detach(self, replica: str) -> None:
        """Forget ``replica`` and everything credited to it (it left the rotation)."""
        with self._lock:
            self._drop(replica)

    def replicas(self) -> list[str]:
        """The replicas with entries (attached)."""
        with self._lock:
            return list(self._replicas)

    # -- events --

    def store(
        self, replica: str, generation: int, digests: Iterable[bytes], medium: str | None
    ) -> bool:
        """``BlockStored``: ``replica`` now holds ``digests`` in ``medium``."""
        with self._lock:
            holdings = self._current(replica, generation)
            if holdings is None:
                return False
            if medium in TIER_MEDIA:
                for digest in digests:
                    self._tier.setdefault(digest, {})[replica] = medium
                    holdings.tier.add(digest)
            else:
                for digest in digests:
                    self._pool.setdefault(digest, set()).add(replica)
                    holdings.pool.add(digest)
            return True

    def remove(
        self, replica: str, generation: int, digests: Iterable[bytes], medium: str | None
    ) -> bool:
        """``BlockRemoved``: the last copy of each digest left ``replica``'s ``medium``."""
        with self._lock:
            holdings = self._current(replica, generation)
            if holdings is None:
                return False
            tier = medium in TIER_MEDIA
            for digest in digests:
                self._unlink(replica, digest, tier)
                (holdings.tier if tier else holdings.pool).discard(digest)
            return True

    def clear_pool(self, replica: str, generation: int) -> bool:
        """``AllBlocksCleared``: the replica's pool was reset (its tier is untouched)."""
        with self._lock:
            holdings = self._current(replica, generation)
            if holdings is None:
                return False
            for digest in holdings.pool:
                self._unlink(replica, digest, tier=False)
            holdings.pool.clear()
            return True

    # -- routing --

    def overlap(self, replica: str, digests: Sequence[bytes]) -> Overlap:
        """Leading ``digests`` in ``replica``'s pool (or expected there), then in its tier."""
        with self._lock:
            self._expire(time.monotonic())
            holdings = self._replicas.get(replica)
            if holdings is None:
                return Overlap()
            pool = 0
            for digest in digests:
                if replica not in self._pool.get(digest, ()) and not holdings.expected[digest]:
                    break
                pool += 1
            tier = 0
            for digest in digests[pool:]:
                if not self._in_tier(replica, holdings, digest):
                    break
                tier += 1
            return Overlap(pool, tier)

    def expect(self, replica: str, digests: Sequence[bytes]) -> Expectation | None:
        """Credit ``replica`` with ``digests`` until ``settle`` (a request was sent there)."""
        with self._lock:
            holdings = self._replicas.get(replica)
            if holdings is None or not digests:
                return None
            holdings.expected.update(digests)
            return Expectation(replica, holdings.generation, tuple(digests))

    def settle(self, expectation: Expectation | None, grace_s: float) -> None:
        """Withdraw an expectation ``grace_s`` from now (time for the events to arrive)."""
        if expectation is None or expectation.settled:
            return
        expectation.settled = True
        with self._lock:
            deadline = time.monotonic() + grace_s
            heapq.heappush(self._settling, (deadline, next(self._order), expectation))
            self._expire(time.monotonic())

    def counts(self, replica: str) -> BlockCounts:
        """Digests credited to ``replica``: pool, own tier writes, expected."""
        with self._lock:
            holdings = self._replicas.get(replica)
            if holdings is None:
                return BlockCounts(0, 0, 0)
            return BlockCounts(len(holdings.pool), len(holdings.tier), len(+holdings.expected))

    def holders(self, digest: bytes) -> set[str]:
        """Replicas with ``digest`` in their pool (for tests and debugging)."""
        with self._lock:
            return set(self._pool.get(digest, ()))

    # -- internals (lock held) --

    def _current(self, replica: str, generation: int) -> _Holdings | None:
        holdings = self._replicas.get(replica)
        return holdings if holdings is not None and holdings.generation == generation else None

    def _in_tier(self, replica: str, holdings: _Holdings, digest: bytes) -> bool:
        """In the replica's own tier, or in a shared tier of the medium it reports."""
        reporters = self._tier.get(digest)
        if not reporters:
            return False
        if replica in reporters:
            return True
        shared = holdings.tier_medium
        return shared in SHARED_TIER_MEDIA and shared in reporters.values()

    def _unlink(self, replica: str, digest: bytes, tier: bool) -> None:
        """Remove ``replica`` from one digest's holders (and the digest once nobody holds it)."""
        table = self._tier if tier else self._pool
        holders = table.get(digest)
        if holders is None:
            return
        if isinstance(holders, dict):
            holders.pop(replica, None)
        else:
            holders.discard(replica)
        if not holders:
            del table[digest]

    def _drop(self, replica: str) -> None:
        holdings = self._replicas.pop(replica, None)
        if holdings is None:
            return
        for digest in holdings.pool:
            self._unlink(replica, digest, tier=False)
        for digest in holdings.tier:
            self._unlink(replica, digest, tier=True)

    def _expire(self, now: float) -> None:
        """Withdraw the expectations whose grace has passed."""
        while self._settling and self._settling[0][0] <= now:
            _, _, expectation = heapq.heappop(self._settling)
            holdings = self._current(expectation.replica, expectation.generation)
            if holdings is not None:
                holdings.expected.subtract(expectation.digests)
                for digest in expectation.digests:
                    if holdings.expected[digest] <= 0:
                        holdings.expected.pop(digest, None)
