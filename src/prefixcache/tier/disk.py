"""The embedded tier: one file per block under a directory, with a size cap.

``PATH/<2 hex>/<64 hex>.kvb`` holds one encoded value. Writes go to ``PATH/tmp/`` and are
fsynced before ``os.replace`` puts them in place, so a crash leaves either the whole block
or nothing that loads. The index (digest -> size, depth, last use) lives in memory and is
rebuilt from the files' headers at start-up; unreadable files and leftover temp files are
deleted then. One process owns PATH at a time (an ``flock`` on ``PATH/lock`` enforces it).
Over the cap, the deepest blocks go first, then the least recently used: suffixes before
the shared prefixes they hang from. Recency survives a restart only as file mtime order.
"""

from __future__ import annotations

import fcntl
import itertools
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from prefixcache.tier.base import KVTier, TierError, TierValueError
from prefixcache.tier.codec import MAX_HEADER, read_header

logger = logging.getLogger(__name__)
SUFFIX = ".kvb"


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
        self._lock_fd = self._take_ownership()
        self._rebuild()
        with self._lock:
            removed = self._make_room(0)
        _notify(self.on_removed, removed)

    # -- start-up ---------------------------------------------------------------------

    def _take_ownership(self) -> int:
        """Create PATH and hold its lock file, so no other process writes here too."""
        try:
            (self.path / "tmp").mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise TierError(f"disk tier {self.path}: {error}") from error
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            os.close(fd)
            raise TierError(f"disk tier {self.path} is in use by another DiskTier") from error
        return fd

    def _rebuild(self) -> None:
        """Delete temp files, then index every block file whose header parses."""
        for leftover in (self.path / "tmp").iterdir():
            leftover.unlink(missing_ok=True)
        found = []
        for folder in self.path.iterdir():
            if len(folder.name) == 2 and folder.is_dir():
                found.extend(self._scan(folder))
        found.sort()  # by mtime: the order of last use, as far as a restart can know
        for _, digest, size, depth in found:
            self._insert(digest, size, depth)
            self.used_bytes += size
        logger.info("disk tier %s: %d blocks, %d bytes", self.path, len(found), self.used_bytes)

    def _scan(self, folder: Path) -> list[tuple[int, bytes, int, int]]:
        """(mtime, digest, size, depth) of the sound block files in one folder."""
        found = []
        for file in folder.glob(f"*{SUFFIX}"):
            try:
                with open(file, "rb", buffering=0) as handle:
                    header = read_header(handle.read(MAX_HEADER))
                    stat = os.fstat(handle.fileno())
                sound = file.stem == header.digest.hex() and stat.st_size == (
                    header.header_len + header.payload_len
                )
            except (OSError, TierValueError):
                sound = False
            if sound:
                found.append((stat.st_mtime_ns, header.digest, stat.st_size, header.depth))
            else:
                logger.warning("disk tier: deleting unreadable block file %s", file.name)
                file.unlink(missing_ok=True)
        return found

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
        try:
            self._file(digest).unlink(missing_ok=True)
        except OSError as error:  # the index forgets it anyway; the next start retries
            logger.warning("disk tier: cannot delete %s: %s", digest.hex()[:12], error)
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

    def _file(self, digest: bytes) -> Path:
        name = digest.hex()
        return self.path / name[:2] / f"{name}{SUFFIX}"

    # -- KVTier -----------------------------------------------------------------------

    def present(self, digests: Sequence[bytes]) -> int:
        """How many leading digests are indexed (no disk access)."""
        with self._lock:
            for count, digest in enumerate(digests):
                if digest not in self._entries:
                    return count
        return len(digests)

    def get(self, digests: Sequence[bytes]) -> list[bytes | None]:
        """Each block file's bytes, or None where absent (a file gone meanwhile is absent)."""
        return [self._read(digest) for digest in digests]

    def _read(self, digest: bytes) -> bytes | None:
        with self._lock:
            entry = self._entries.get(digest)
            if entry is None:
                return None
            self._touch(digest, entry)
        try:
            with open(self._file(digest), "rb", buffering=0) as handle:
                return handle.readall()
        except FileNotFoundError:
            with self._lock:
                self._remove(digest)
            return None
        except OSError as error:
            raise TierError(f"disk tier read {digest.hex()[:12]}: {error}") from error

    def put(self, digest: bytes, value: bytes, depth: int) -> bool:
        """Write one block file atomically, evicting others first if the cap needs it."""
        with self._lock:
            if digest in self._entries or digest in self._pending or len(value) > self.max_bytes:
                return False
            self._pending.add(digest)
            removed = self._make_room(len(value))
            self.used_bytes += len(value)  # reserved now, so concurrent puts respect the cap
        try:
            self._write(digest, value)
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

    def _write(self, digest: bytes, value: bytes) -> None:
        final = self._file(digest)
        temp = self.path / "tmp" / f"{final.name}.{os.getpid()}.{threading.get_ident()}"
        try:
            with open(temp, "wb") as handle:
                handle.write(value)
                handle.flush()
                if self.fsync:
                    os.fsync(handle.fileno())
            final.parent.mkdir(exist_ok=True)
            os.replace(temp, final)
        finally:
            temp.unlink(missing_ok=True)

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
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
