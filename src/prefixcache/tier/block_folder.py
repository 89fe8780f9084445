"""The disk tier's folder, opened without trusting any name in it.

``BlockFolder`` does the file I/O of ``DiskTier``: it checks PATH and takes its lock, empties
``PATH/tmp``, scans ``PATH/<2 hex>/<64 hex>.kvb`` at start-up, and reads, writes and unlinks
block files and their retention records (``<64 hex>.ret`` beside a retained block: magic,
digest, expiry as float64 wall-clock seconds; untrusted, checked like a block file, removed
with its block or when its block is gone), all through ``safe_files`` (``O_NOFOLLOW`` opens
relative to folder fds, fstat checks, bounded reads). A name that is not a sound block file
of ours is counted in ``rejected`` by reason, logged once by its first 12 characters (never
its contents), and its name is unlinked: a symlink goes, its target stays; a folder is never
removed.
"""

from __future__ import annotations

import fcntl
import logging
import math
import os
import re
import struct
import threading
from pathlib import Path

from prefixcache.tier.base import TierError, TierValueError
from prefixcache.tier.codec import MAX_HEADER, read_header
from prefixcache.tier.safe_files import (
    Rejected,
    check_file,
    create_file,
    make_dir,
    open_dir,
    open_lock_file,
    open_private_root,
    problem_text,
    read_regular,
    remove_name,
)

logger = logging.getLogger(__name__)
SUFFIX = ".kvb"
RETAINED = ".ret"  # a retained block's expiry record
RECORD = struct.Struct("<4s32sd")  # magic, digest, expiry (wall-clock seconds)
RECORD_MAGIC = b"PCRT"
SHARD = re.compile(r"[0-9a-f]{2}")
REPLACEABLE = ("symlink", "not_folder")  # a subfolder name we may unlink and make again
Found = tuple[int, bytes, int, int, float | None]  # mtime_ns, digest, size, depth, expiry


def names(digest: bytes, suffix: str = SUFFIX) -> tuple[str, str]:
    """(subfolder, file name) of a digest's block file (or retention record)."""
    hexed = digest.hex()
    return hexed[:2], f"{hexed}{suffix}"


def parse_record(data: bytes, digest: bytes) -> float:
    """The expiry in a retention record of ``digest``; Rejected if it is not a sound one."""
    magic, named, expiry = RECORD.unpack(data)
    if magic != RECORD_MAGIC or named != digest:
        raise Rejected("bad_retention", "not a retention record of its block")
    if not math.isfinite(expiry) or expiry <= 0:
        raise Rejected("bad_retention", "its expiry is not a time")
    return expiry


class BlockFolder:
    """PATH, owned (flock) and checked; thread-safe file I/O for one block per file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rejected: dict[str, int] = {}
        self._count_lock = threading.Lock()
        self._fds: list[int] = []
        try:
            self._root = self._keep(open_private_root(path))
            self._own()
            self._tmp = self._keep(self._subfolder("tmp"))
            self._clean_tmp()
        except BaseException:
            self.close()
            raise

    def _keep(self, fd: int) -> int:
        self._fds.append(fd)
        return fd

    def _own(self) -> None:
        """Hold an ``flock`` on PATH/lock, so no other process writes here too."""
        lock_fd = self._keep(open_lock_file(self._root, "lock", self.path / "lock"))
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            raise TierError(f"disk tier {self.path} is in use by another DiskTier") from error

    def close(self) -> None:
        """Close the folder fds (releasing the lock); the files stay."""
        while self._fds:
            os.close(self._fds.pop())

    # -- subfolders -------------------------------------------------------------------

    def _subfolder(self, name: str) -> int:
        """An fd of a real subfolder of ours, made if missing; a symlink or file there goes.

        TierError (saying how to fix it) if it is a stranger's or others can write it.
        """
        try:
            try:
                return make_dir(self._root, name)
            except Rejected as problem:
                if problem.reason not in REPLACEABLE:
                    raise
                self._reject(self._root, name, problem)
            return make_dir(self._root, name)
        except Rejected as problem:
            shown = self.path / name
            raise TierError(f"disk tier {shown}: {problem_text(shown, problem)}") from None

    def _clean_tmp(self) -> None:
        """Unlink the regular files and symlinks directly in PATH/tmp; never recurse."""
        with os.scandir(self._tmp) as entries:
            for entry in entries:
                if entry.is_symlink():
                    self._reject(self._tmp, entry.name, Rejected("symlink", "in tmp"))
                elif entry.is_file(follow_symlinks=False):
                    remove_name(self._tmp, entry.name)
                else:
                    self._note(entry.name, Rejected("not_regular", "in tmp"), "left alone")

    # -- start-up scan ----------------------------------------------------------------

    def scan(self) -> list[Found]:
        """Every sound block file; TierError if a subfolder is a stranger's or others'."""
        found, bad = [], []
        with os.scandir(self._root) as entries:
            shards = sorted(entry.name for entry in entries if SHARD.fullmatch(entry.name))
        for shard in shards:
            try:
                found.extend(self._scan(shard))
            except Rejected as problem:
                bad.append((shard, problem))
        if bad:
            raise self._refusal(bad)
        return found

    def _refusal(self, bad: list[tuple[str, Rejected]]) -> TierError:
        """One TierError for every subfolder others may write, with one fix for them all."""
        shown = self.path / bad[0][0]
        more = len(bad) - 1
        more = f" (and {more} more subfolder{'s' * (more > 1)})" if more else ""
        text = problem_text(shown, bad[0][1], fix_all=self.path)
        return TierError(f"disk tier {shown}: {text}{more}")

    def _scan(self, shard: str) -> list[Found]:
        """The sound block files of one subfolder; a symlinked subfolder's name is unlinked."""
        try:
            fd = open_dir(self._root, shard)
        except Rejected as problem:
            if problem.reason == "symlink":
                self._reject(self._root, shard, problem)
            if problem.reason in REPLACEABLE:  # a file named like a subfolder is not ours
                return []
            raise
        try:
            with os.scandir(fd) as entries:
                listed = [entry.name for entry in entries]
            files = [name for name in listed if name.endswith(SUFFIX)]
            records = {name for name in listed if name.endswith(RETAINED)}
            found = [hit for name in files if (hit := self._scan_file(fd, shard, name))]
            found = [self._with_expiry(fd, hit, records) for hit in found]
            for orphan in records:  # its block is gone (a removal cut short): it goes too
                remove_name(fd, orphan)
            return found
        finally:
            os.close(fd)

    def _with_expiry(self, fd: int, hit: Found, records: set[str]) -> Found:
        """``hit`` with the expiry of its retention record, if it has a sound one."""
        name = names(hit[1], RETAINED)[1]
        if name not in records:
            return hit
        records.discard(name)
        try:
            data, _ = read_regular(fd, name, RECORD.size + 1, RECORD.size)
            return (*hit[:4], parse_record(data, hit[1]))
        except FileNotFoundError:
            pass
        except OSError as error:
            self._reject(fd, name, Rejected("unreadable", os.strerror(error.errno or 0)))
        except Rejected as problem:
            self._reject(fd, name, problem)
        return hit

    def _scan_file(self, fd: int, shard: str, name: str) -> Found | None:
        """One block file's entry if its header and size are sound; else it is rejected."""
        try:
            data, info = read_regular(fd, name, MAX_HEADER)
            header = read_header(data)
            if name != f"{header.digest.hex()}{SUFFIX}" or name[:2] != shard:
                raise Rejected("bad_header", "its name is not its digest")
            check_file(info, header.stored_len)
        except FileNotFoundError:
            return None
        except TierValueError as error:
            return self._reject(fd, name, Rejected("bad_header", error.reason))
        except OSError as error:
            return self._reject(fd, name, Rejected("unreadable", os.strerror(error.errno or 0)))
        except Rejected as problem:
            return self._reject(fd, name, problem)
        return info.st_mtime_ns, header.digest, info.st_size, header.depth, None

    # -- block files while running --------------------------------------------------------

    def read(self, digest: bytes, size: int) -> bytes | None:
        """The ``size`` bytes of a block file; None if gone or rejected (then it is unlinked).

        Reads at most ``size + 1`` bytes. TierError on other I/O errors.
        """
        shard, name = names(digest)
        try:
            fd = open_dir(self._root, shard)
            try:
                return read_regular(fd, name, size + 1, size)[0]
            except Rejected as problem:
                self._reject(fd, name, problem)
            finally:
                os.close(fd)
        except FileNotFoundError:
            pass
        except Rejected as problem:  # the subfolder itself: leave it to the next start
            self._note(shard, problem, "block unread")
        except OSError as error:
            raise TierError(f"disk tier read {name[:12]}: {error}") from error
        return None

    def write(self, digest: bytes, value: bytes, fsync: bool) -> None:
        """Write a block file atomically: a 0600 temp file, fsync, ``os.replace``."""
        self._replace(*names(digest), value, fsync)

    def write_expiry(self, digest: bytes, expiry: float, fsync: bool) -> None:
        """Write (or replace) a block's retention record, atomically like a block file."""
        data = RECORD.pack(RECORD_MAGIC, digest, expiry)
        self._replace(*names(digest, RETAINED), data, fsync)

    def _replace(self, shard: str, name: str, value: bytes, fsync: bool) -> None:
        """Put ``value`` in place as ``shard/name``: temp file, fsync, ``os.replace``."""
        temp = f"{name}.{os.getpid()}.{threading.get_ident()}"
        remove_name(self._tmp, temp)  # a leftover of an earlier thread with this id
        try:
            with open(create_file(self._tmp, temp), "wb") as handle:
                handle.write(value)
                handle.flush()
                if fsync:
                    os.fsync(handle.fileno())
            shard_fd = self._subfolder(shard)
            try:
                os.replace(temp, name, src_dir_fd=self._tmp, dst_dir_fd=shard_fd)
            finally:
                os.close(shard_fd)
        finally:
            remove_name(self._tmp, temp)

    def unlink(self, digest: bytes, suffixes: tuple[str, ...] = (RETAINED, SUFFIX)) -> None:
        """Remove a block file's name and its retention record's; a failure is logged (the
        next start retries). ``suffixes=(RETAINED,)``: the record only."""
        shard = names(digest)[0]
        try:
            fd = open_dir(self._root, shard)
        except (OSError, Rejected):
            return  # no subfolder of ours: nothing of ours to delete
        try:
            for suffix in suffixes:
                name = names(digest, suffix)[1]
                error = remove_name(fd, name)
                if error is not None:
                    logger.warning("disk tier: cannot delete %s: %s", name[:12], error)
        finally:
            os.close(fd)

    # -- rejected names ---------------------------------------------------------------

    def rejected_counts(self) -> dict[str, int]:
        """A copy of ``rejected``: names that were not sound block files, by reason."""
        with self._count_lock:
            return dict(self.rejected)

    def _reject(self, dir_fd: int, name: str, problem: Rejected) -> None:
        """Count, log and unlink a name that is not a sound block file of ours."""
        error = remove_name(dir_fd, name)
        self._note(name, problem, "removed" if error is None else f"left in place: {error}")

    def _note(self, name: str, problem: Rejected, outcome: str) -> None:
        """Count a rejected name by reason and log it once, by its first 12 characters."""
        with self._count_lock:
            self.rejected[problem.reason] = self.rejected.get(problem.reason, 0) + 1
        logger.warning("disk tier %s: rejected %s (%s); %s", self.path, name[:12], problem, outcome)
