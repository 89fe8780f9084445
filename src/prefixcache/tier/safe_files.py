"""Opening names in a folder others may have tampered with: no links, no FIFOs, no strangers.

Every open is relative to a directory fd and uses ``O_NOFOLLOW`` (a symlink fails with
ELOOP, or ENOTDIR for a folder) and, for reads, ``O_NONBLOCK`` (a FIFO opens at once instead
of waiting for a writer). The fd is then ``fstat``-ed: only a regular file or real directory
owned by this process's effective uid, not writable by group or others, is accepted; anything
else raises ``Rejected`` with a short reason. Reads are bounded. Removal unlinks a *name*
(a symlink goes, never its target) and never recurses. Permission checks use owner and mode
bits, not ``os.access``: a root process may access everything.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from prefixcache.tier.base import TierError

DIR_MODE, FILE_MODE = 0o700, 0o600
LOOSE_BITS = 0o022  # group or other write
_COMMON = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY
READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | _COMMON
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | _COMMON
CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _COMMON


class Rejected(Exception):
    """A name that is not a file or folder this process made; ``reason`` is a counter key."""

    def __init__(self, reason: str, detail: str = "", mode: int = 0) -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.mode = reason, mode


def owner_problem(info: os.stat_result) -> Rejected | None:
    """Why a file or folder is not private to this process (owner, mode), or None."""
    uid = os.geteuid()
    if info.st_uid != uid:
        detail = f"owned by uid {info.st_uid}, not by this process's uid {uid}"
        return Rejected("foreign_owner", detail, info.st_mode)
    loose = info.st_mode & LOOSE_BITS
    if loose:
        who = {0o020: "group", 0o002: "others"}.get(loose, "group and others")
        mode = f"mode {info.st_mode & 0o7777:04o}"
        return Rejected("writable_by_others", f"writable by {who} ({mode})", info.st_mode)
    return None


def _link_or(parent_fd: int | None, name: str, error: OSError, other: str) -> Rejected:
    """The Rejected for a failed ``O_NOFOLLOW`` open: a symlink, or ``other``."""
    try:
        if stat.S_ISLNK(os.lstat(name, dir_fd=parent_fd).st_mode):
            return Rejected("symlink", "a symbolic link")
    except OSError:
        pass
    return Rejected(other, os.strerror(error.errno or 0))


def _open_dir_fd(parent_fd: int | None, name: str) -> int:
    """An fd of the directory ``name`` itself (not a link to one); Rejected otherwise."""
    try:
        return os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except OSError as error:
        if error.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
        raise _link_or(parent_fd, name, error, "not_folder") from None


def _checked(fd: int) -> int:
    """``fd`` if it is a directory private to us; closed and Rejected otherwise."""
    problem = owner_problem(os.fstat(fd))
    if problem is not None:
        os.close(fd)
        raise problem
    return fd


def open_dir(parent_fd: int | None, name: str) -> int:
    """An fd of the real directory ``name`` we own; Rejected if it is anything else."""
    return _checked(_open_dir_fd(parent_fd, name))


def make_dir(parent_fd: int | None, name: str) -> int:
    """``open_dir``, creating the directory owner-only (0700 whatever the umask) if missing."""
    try:
        return open_dir(parent_fd, name)
    except FileNotFoundError:
        pass
    try:
        os.mkdir(name, DIR_MODE, dir_fd=parent_fd)
    except FileExistsError:  # made meanwhile
        return open_dir(parent_fd, name)
    fd = _open_dir_fd(parent_fd, name)
    os.fchmod(fd, DIR_MODE)
    return _checked(fd)


def check_file(info: os.stat_result, size: int | None) -> None:
    """Rejected unless a regular file we own, not writable by others, of ``size`` bytes."""
    if not stat.S_ISREG(info.st_mode):
        raise Rejected("not_regular", f"file type {stat.S_IFMT(info.st_mode):o}")
    problem = owner_problem(info)
    if problem is not None:
        raise problem
    if size is not None and info.st_size != size:
        raise Rejected("wrong_size", f"{info.st_size} bytes, expected {size}")


def read_regular(
    dir_fd: int, name: str, limit: int, size: int | None = None
) -> tuple[bytes, os.stat_result]:
    """At most ``limit`` bytes of the file ``name`` (of exactly ``size`` bytes, if given), and
    its ``fstat``.

    FileNotFoundError if it is gone; Rejected if it is not a file we wrote (``wrong_size``
    also if it grew or shrank meanwhile); other OSErrors as they come.
    """
    try:
        fd = os.open(name, READ_FLAGS, dir_fd=dir_fd)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise Rejected("symlink", "a symbolic link") from None
        if error.errno == errno.ENXIO:  # a socket, or a device with nothing behind it
            raise Rejected("not_regular", "not openable as a file") from None
        raise
    try:
        info = os.fstat(fd)
        check_file(info, size)
        data = _read_at_most(fd, limit)
    finally:
        os.close(fd)
    if size is not None and len(data) != size:
        raise Rejected("wrong_size", f"read {len(data)} bytes, expected {size}")
    return data, info


def _read_at_most(fd: int, limit: int) -> bytes:
    """Read until end of file or ``limit`` bytes, whichever comes first."""
    chunks, total = [], 0
    while total < limit:
        chunk = os.read(fd, limit - total)
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def create_file(dir_fd: int, name: str) -> int:
    """A new owner-only (0600 whatever the umask) file ``name`` open for writing."""
    fd = os.open(name, CREATE_FLAGS, FILE_MODE, dir_fd=dir_fd)
    os.fchmod(fd, FILE_MODE)
    return fd


def remove_name(dir_fd: int, name: str) -> str | None:
    """Unlink ``name`` itself (never a link's target, never a folder); why not, or None."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as error:  # a directory (EISDIR) or a read-only filesystem
        return os.strerror(error.errno or 0)
    return None


def open_lock_file(dir_fd: int, name: str, shown: Path) -> int:
    """The lock file ``name``, created 0600; TierError if it is a link or not a file of ours."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | _COMMON
    try:
        fd = os.open(name, flags, FILE_MODE, dir_fd=dir_fd)
    except OSError as error:
        why = "a symbolic link" if error.errno == errno.ELOOP else os.strerror(error.errno or 0)
        raise TierError(f"disk tier {shown}: {why}; remove it") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
        os.close(fd)
        why = f"not a regular file owned by uid {os.geteuid()}"
        raise TierError(f"disk tier {shown}: {why}; remove it")
    os.fchmod(fd, FILE_MODE)  # an older lock file may be 0644
    return fd


def make_private_root(path: Path) -> None:
    """Create ``path`` and any missing parents owner-only (0700); existing ones stay as they are."""
    missing = []
    while not os.path.lexists(path):
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        os.close(make_dir(None, str(folder)))


def open_private_root(path: Path) -> int:
    """An fd of ``path``, which must be a real folder of ours that only we can write.

    TierError says which path, what is wrong and how to fix it.
    """
    try:
        make_private_root(path)
        return open_dir(None, str(path))
    except Rejected as problem:
        raise TierError(f"disk tier {path}: {problem_text(path, problem)}") from None
    except OSError as error:
        raise TierError(f"disk tier {path}: {error}") from error


def problem_text(path: Path, problem: Rejected, fix_all: Path | None = None) -> str:
    """What is wrong with ``path`` and the command that fixes it (for the whole tree, if given)."""
    detail = str(problem).partition(": ")[2] or problem.reason
    if problem.reason == "symlink":
        target = os.path.realpath(path)
        return f"a symbolic link to {target}; use `disk:{target}` or put a real folder there"
    if problem.reason == "not_folder":
        return f"not a folder ({detail}); move it away or choose another path"
    if problem.mode & stat.S_ISVTX:  # a shared folder like /tmp: never chmod or chown that
        return f"{detail}; use a folder of its own inside it, e.g. `disk:{path}/kv`"
    if problem.reason == "foreign_owner":
        return f"{detail}; run `chown -R {os.geteuid()} {fix_all or path}` or choose another path"
    fix = f"chmod -R go-w {fix_all}" if fix_all else f"chmod 700 {path}"
    return f"{detail}; run `{fix}`"
