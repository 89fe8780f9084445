"""The embedded tier: one file per block under a directory, with a size cap.

``PATH/<2 hex>/<64 hex>.kvb`` holds one encoded value. Writes go to ``PATH/tmp/`` and are
fsynced before ``os.replace`` puts them in place, so a crash leaves either the whole block
or nothing that loads. The index (digest -> size, depth, last use) lives in memory and is
rebuilt from the files' headers at start-up; leftover temp files are deleted then. One
process owns PATH at a time (an ``flock`` on ``PATH/lock`` enforces it).
Over the cap, the deepest blocks go first, then the least recently used: suffixes before
the shared prefixes they hang from. Recency survives a restart only as file mtime order.
Retained blocks (``put(..., ttl_seconds)``, ``retain``: the cache's retention marks) keep an
expiry in wall-clock seconds, in a small record beside the block file, so it survives a
restart; the cap takes them only once no other block is left, earliest expiry first. An
expired block is an ordinary one again, in its place by last use (it is not deleted).

Nothing in PATH is trusted (``block_folder``, ``safe_files``): PATH and its subfolders must
be real folders of ours that group and others cannot write, or start-up fails saying how to
fix it; new folders are 0700 and files 0600. A name that is not a regular file of ours of
the expected size (a symlink, a FIFO, a device, a stranger's or a torn file) is never
followed nor read past that size: it is a miss, logged by digest prefix, counted in
``rejected_files`` by reason, and its name (never a link's target) is unlinked.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from prefixcache.tier.base import KVTier, TierError
from prefixcache.tier.block_folder import RETAINED, BlockFolder

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Entry:
    size: int
    depth: int
    last_use: int
    expiry: float | None = None  # wall-clock seconds while retained (then not in a bucket)


def _notify(callback: Callable | None, arg: object) -> None:
    """Run a caller's callback; its failure must not break the store."""
    if callback is None or not arg:
        return
    try:
        callback(arg)
    except Exception:
        logger.exception("disk tier callback %s failed", getattr(callback, "__name__", "?"))


class DiskTier(KVTier):
    """Blocks as files on a local disk; thread-safe, with eviction to ``max_bytes``.

    ``on_stored(digest)`` and ``on_removed(digests)`` run on the thread that caused them
    (the writer thread for puts and evictions), outside the lock, e.g. to publish KV events.
    ``clock`` is the wall clock retention expiries are kept in.
    """

    medium = "disk"

    def __init__(
        self,
        path: str | os.PathLike[str],
        max_bytes: int,
        *,
        on_stored: Callable[[bytes], None] | None = None,
        on_removed: Callable[[list[bytes]], None] | None = None,
        fsync: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path, self.max_bytes, self.fsync, self.clock = Path(path), max_bytes, fsync, clock
        self.on_stored, self.on_removed = on_stored, on_removed
        self.used_bytes = 0
        self.evictions = 0
        self._lock = threading.Lock()
        self._entries: dict[bytes, _Entry] = {}
        self._by_depth: dict[int, OrderedDict[bytes, None]] = {}  # LRU first, per depth
        self._retained: list[tuple[float, bytes]] = []  # heap of (expiry, digest), lazy
        self._num_retained = 0
        self._record_lock = threading.Lock()  # one retention record write at a time
        self._pending: set[bytes] = set()
        self._ticks = itertools.count(1)
        self._folder = BlockFolder(self.path)  # TierError if PATH is not safe to use
        try:
            self._rebuild()
        except BaseException:
            self._folder.close()
            raise
        with self._lock:
            removed = self._make_room(0)
        _notify(self.on_removed, removed)

    @property
    def rejected_files(self) -> dict[str, int]:
        """Names in PATH that were not sound block files of ours, by reason (a copy)."""
        return self._folder.rejected_counts()

    def _rebuild(self) -> None:
        """Index every sound block file, in mtime order (the last use a restart can know)."""
        found = sorted(self._folder.scan())
        now = self.clock()
        for _, digest, size, depth, expiry in found:
            if expiry is not None and expiry <= now:
                self._folder.unlink(digest, suffixes=(RETAINED,))
                expiry = None
            self._insert(digest, size, depth, expiry)
            self.used_bytes += size
        logger.info("disk tier %s: %d blocks, %d bytes", self.path, len(found), self.used_bytes)

    # -- index (callers hold self._lock) ------------------------------------------------

    def _insert(self, digest: bytes, size: int, depth: int, expiry: float | None = None) -> None:
        entry = self._entries[digest] = _Entry(size, depth, next(self._ticks))
        if expiry is None:
            self._by_depth.setdefault(depth, OrderedDict())[digest] = None
        else:
            self._mark(digest, entry, expiry)

    def _touch(self, digest: bytes, entry: _Entry) -> None:
        entry.last_use = next(self._ticks)
        if entry.expiry is None:
            self._by_depth[entry.depth].move_to_end(digest)

    def _unbucket(self, digest: bytes, entry: _Entry) -> None:
        bucket = self._by_depth[entry.depth]
        del bucket[digest]
        if not bucket:
            del self._by_depth[entry.depth]

    def _mark(self, digest: bytes, entry: _Entry, expiry: float) -> None:
        """Retain an indexed block until ``expiry``: out of its bucket, into the heap."""
        if entry.expiry is None:
            if digest in self._by_depth.get(entry.depth, ()):
                self._unbucket(digest, entry)
            self._num_retained += 1
        entry.expiry = expiry
        heapq.heappush(self._retained, (expiry, digest))
        if len(self._retained) > 2 * self._num_retained + 64:
            live = self._entries.items()
            self._retained = [(e.expiry, d) for d, e in live if e.expiry is not None]
            heapq.heapify(self._retained)

    def _live(self, expiry: float, digest: bytes) -> _Entry | None:
        """The entry a heap item stands for, if it is still retained until ``expiry``."""
        entry = self._entries.get(digest)
        return entry if entry is not None and entry.expiry == expiry else None

    def _unmark_expired(self) -> None:
        """Expired retained blocks back into their buckets, in last-use order."""
        now, heap, back = self.clock(), self._retained, []
        while heap and heap[0][0] <= now:
            expiry, digest = heapq.heappop(heap)
            if (entry := self._live(expiry, digest)) is not None:
                entry.expiry = None
                self._num_retained -= 1
                back.append(digest)
        for depth in {self._entries[digest].depth for digest in back}:
            bucket = self._by_depth.get(depth, OrderedDict())
            mine = [digest for digest in back if self._entries[digest].depth == depth]
            merged = sorted([*bucket, *mine], key=lambda d: self._entries[d].last_use)
            self._by_depth[depth] = OrderedDict.fromkeys(merged)

    def _earliest(self) -> bytes:
        """The retained block expiring first (only called while one is indexed)."""
        while True:
            expiry, digest = heapq.heappop(self._retained)
            if self._live(expiry, digest) is not None:
                return digest

    def _remove(self, digest: bytes) -> bool:
        entry = self._entries.pop(digest, None)
        if entry is None:
            return False
        if entry.expiry is None:
            self._unbucket(digest, entry)
        else:
            self._num_retained -= 1  # its heap item is dead now
        self.used_bytes -= entry.size
        self._folder.unlink(digest)  # the index forgets it anyway; the next start retries
        return True

    def _make_room(self, size: int) -> list[bytes]:
        """Evict deepest-then-oldest unretained blocks until ``size`` more bytes fit under
        the cap; then retained ones, earliest expiry first."""
        removed = []
        self._unmark_expired()
        while self.used_bytes + size > self.max_bytes and self._entries:
            if self._by_depth:
                victim = next(iter(self._by_depth[max(self._by_depth)]))
            else:
                victim = self._earliest()
            self._remove(victim)
            removed.append(victim)
        self.evictions += len(removed)
        return removed

    # -- KVTier -----------------------------------------------------------------------

    def present(self, digests: Sequence[bytes]) -> int:
        """How many leading digests are indexed (no disk access)."""
        with self._lock:
            for count, digest in enumerate(digests):
                if digest not in self._entries:
                    return count
        return len(digests)

    def get(self, digests: Sequence[bytes]) -> list[bytes | None]:
        """Each block file's bytes, or None where absent, gone or rejected (then forgotten)."""
        values, gone = [], []
        for digest in digests:
            value, indexed = self._read(digest)
            values.append(value)
            if value is None and indexed:
                gone.append(digest)
        _notify(self.on_removed, gone)
        return values

    def _read(self, digest: bytes) -> tuple[bytes | None, bool]:
        """(the block's bytes or None, whether it was indexed); a lost block is unindexed."""
        with self._lock:
            entry = self._entries.get(digest)
            if entry is None:
                return None, False
            self._touch(digest, entry)
            size = entry.size
        value = self._folder.read(digest, size)
        if value is None:
            with self._lock:
                return None, self._remove(digest)
        return value, True

    def put(
        self, digest: bytes, value: bytes, depth: int, ttl_seconds: float | None = None
    ) -> bool:
        """Write one block file atomically, evicting others first if the cap needs it; with
        ``ttl_seconds``, it is retained that long (a block already stored: ``retain``)."""
        with self._lock:
            stored = digest in self._entries
            if stored or digest in self._pending or len(value) > self.max_bytes:
                removed = None
            else:
                self._pending.add(digest)
                removed = self._make_room(len(value))
                self.used_bytes += len(value)  # reserved now, so concurrent puts respect the cap
        if removed is None:
            if stored and ttl_seconds is not None:
                self.retain(digest, ttl_seconds)
            return False
        expiry = None if ttl_seconds is None else self.clock() + ttl_seconds
        try:
            self._folder.write(digest, value, self.fsync)
        except OSError as error:
            with self._lock:
                self._pending.discard(digest)
                self.used_bytes -= len(value)
            raise TierError(f"disk tier write {digest.hex()[:12]}: {error}") from error
        with self._lock:
            self._pending.discard(digest)
            self._insert(digest, len(value), depth, expiry)
        if expiry is not None:
            self._write_record(digest)
        _notify(self.on_removed, removed)
        _notify(self.on_stored, digest)
        return True

    def retain(self, digest: bytes, ttl_seconds: float) -> bool:
        """Keep a stored block until ``ttl_seconds`` from now, if that is later than its
        current expiry; False if it is not stored."""
        expiry = self.clock() + ttl_seconds
        with self._lock:
            entry = self._entries.get(digest)
            if entry is None:
                return False
            if entry.expiry is not None and entry.expiry >= expiry:
                return True
            self._mark(digest, entry, expiry)
        self._write_record(digest)
        return True

    def retained_until(self, digest: bytes) -> float | None:
        """The wall-clock expiry of a retained stored block; None if unretained or expired."""
        with self._lock:
            entry = self._entries.get(digest)
            expiry = None if entry is None else entry.expiry
        return expiry if expiry is not None and expiry > self.clock() else None

    def _write_record(self, digest: bytes) -> None:
        """Persist a block's current expiry; a failure only loses it at the next start."""
        with self._record_lock:  # records land in the order of their expiries
            with self._lock:
                entry = self._entries.get(digest)
                expiry = None if entry is None else entry.expiry
            if expiry is None:
                return
            try:
                self._folder.write_expiry(digest, expiry, self.fsync)
            except OSError as error:
                shown = digest.hex()[:12]
                logger.warning("disk tier: cannot record %s's retention: %s", shown, error)

    def discard(self, digests: Sequence[bytes]) -> None:
        """Delete damaged blocks so they can be written again."""
        with self._lock:
            removed = [digest for digest in digests if self._remove(digest)]
        _notify(self.on_removed, removed)

    def digests(self) -> list[bytes]:
        """Every stored digest, e.g. to announce the blocks found at start-up."""
        with self._lock:
            return list(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def close(self) -> None:
        """Release PATH's lock; the files stay for the next start."""
        self._folder.close()
