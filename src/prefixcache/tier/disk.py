"""The embedded tier: one file per block under a directory, with a size cap.

``PATH/<2 hex>/<64 hex>.kvb`` holds one encoded value. Writes go to ``PATH/tmp/`` and are
fsynced before ``os.replace`` puts them in place, so a crash leaves either the whole block
or nothing that loads. The index (digest -> size, depth, last use) lives in memory and is
rebuilt from the files' headers at start-up; leftover temp files are deleted then. One
process owns PATH at a time (an ``flock`` on ``PATH/lock`` enforces it).
Over the cap, the deepest blocks go first, then the least recently used: suffixes before
the shared prefixes they hang from. Recency survives a restart only as file mtime order.

Nothing in PATH is trusted (``block_folder``, ``safe_files``): PATH and its subfolders must
be real folders of ours that group and others cannot write, or start-up fails saying how to
fix it; new folders are 0700 and files 0600. A name that is not a regular file of ours of
the expected size (a symlink, a FIFO, a device, a stranger's or a torn file) is never
followed nor read past that size: it is a miss, logged by digest prefix, counted in
``rejected_files`` by reason, and its name (never a link's target) is unlinked.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from prefixcache.tier.base import KVTier, TierError
from prefixcache.tier.block_folder import BlockFolder

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Entry:
    size: int
    depth: int
    last_use: int


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
    ) -> None:
        self.path, self.max_bytes, self.fsync = Path(path), max_bytes, fsync
        self.on_stored, self.on_removed = on_stored, on_removed
        self.used_bytes = 0
        self.evictions = 0
        self._lock = threading.Lock()
        self._entries: dict[bytes, _Entry] = {}
        self._by_depth: dict[int, OrderedDict[bytes, None]] = {}  # LRU first, per depth
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
        for _, digest, size, depth in found:
            self._insert(digest, size, depth)
            self.used_bytes += size
        logger.info("disk tier %s: %d blocks, %d bytes", self.path, len(found), self.used_bytes)

    # -- index (callers hold self._lock) ------------------------------------------------

    def _insert(self, digest: bytes, size: int, depth: int) -> None:
        self._entries[digest] = _Entry(size, depth, next(self._ticks))
        self._by_depth.setdefault(depth, OrderedDict())[digest] = None

    def _touch(self, digest: bytes, entry: _Entry) -> None:
        entry.last_use = next(self._ticks)
        self._by_depth[entry.depth].move_to_end(digest)

    def _remove(self, digest: bytes) -> bool:
        entry = self._entries.pop(digest, None)
        if entry is None:
            return False
        bucket = self._by_depth[entry.depth]
        del bucket[digest]
        if not bucket:
            del self._by_depth[entry.depth]
        self.used_bytes -= entry.size
        self._folder.unlink(digest)  # the index forgets it anyway; the next start retries
        return True

    def _make_room(self, size: int) -> list[bytes]:
        """Evict deepest-then-oldest blocks until ``size`` more bytes fit under the cap."""
        removed = []
        while self.used_bytes + size > self.max_bytes and self._by_depth:
            victim = next(iter(self._by_depth[max(self._by_depth)]))
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

    def put(self, digest: bytes, value: bytes, depth: int) -> bool:
        """Write one block file atomically, evicting others first if the cap needs it."""
        with self._lock:
            if digest in self._entries or digest in self._pending or len(value) > self.max_bytes:
                return False
            self._pending.add(digest)
            removed = self._make_room(len(value))
            self.used_bytes += len(value)  # reserved now, so concurrent puts respect the cap
        try:
            self._folder.write(digest, value, self.fsync)
        except OSError as error:
            with self._lock:
                self._pending.discard(digest)
                self.used_bytes -= len(value)
            raise TierError(f"disk tier write {digest.hex()[:12]}: {error}") from error
        with self._lock:
            self._pending.discard(digest)
            self._insert(digest, len(value), depth)
        _notify(self.on_removed, removed)
        _notify(self.on_stored, digest)
        return True

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
