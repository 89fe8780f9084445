"""The tenant secret file: hex on one line, owner-only, created once if absent.

Replicas that share it derive the same tenant salts and tier keys, so they share a
tenant's tier blocks, and a restarted server finds its own blocks again. Whoever reads it
can compute every tenant's salt and open its tier values, so a file that anyone but its
owner can read or write is refused. A second line, during a rotation, holds the previous
secret: its tier values are still read (under the previous salts), never written.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import NamedTuple

SECRET_BYTES = 32  # a tenant secret as prefixcache creates it
MIN_SECRET_BYTES = 16  # the shortest one it accepts
MAX_SECRET_FILE_BYTES = 4096  # far more than one secret line; a bigger file is not one


class TenantSecrets(NamedTuple):
    """The current tenant secret, and the previous one while a rotation lasts."""

    current: bytes
    previous: bytes | None = None


def load_or_create_secret(path: str | Path) -> bytes:
    """The current tenant secret kept in ``path``; created if absent (random, mode 0600)."""
    return load_secrets(path).current


def load_secrets(path: str | Path) -> TenantSecrets:
    """The secrets kept in ``path`` (created if absent: one random secret, mode 0600).

    ValueError, naming the file, what is wrong and how to fix it, for a file that is not
    a regular file of ours, that others may read or write, or that is not hex.
    """
    path = Path(path)
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return TenantSecrets(_create_secret(path))
    except OSError as error:  # a symlink (ELOOP), no permission, ...
        raise ValueError(f"tenant secret file {path}: cannot open it ({error.strerror})") from None
    with os.fdopen(descriptor, "rb") as file:
        _check_private(path, os.fstat(file.fileno()))
        data = file.read(MAX_SECRET_FILE_BYTES + 1)
    if len(data) > MAX_SECRET_FILE_BYTES:
        raise ValueError(
            f"tenant secret file {path}: over {MAX_SECRET_FILE_BYTES} bytes{_hint(path)}"
        )
    return _parse_lines(path, data)


def _check_private(path: Path, info: os.stat_result) -> None:
    """A regular file owned by this user that no one else can read or write."""
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"tenant secret file {path}: not a regular file{_hint(path)}")
    if info.st_uid != os.geteuid():
        raise ValueError(
            f"tenant secret file {path}: owned by uid {info.st_uid}, not by this user "
            f"(uid {os.geteuid()}); run: chown {os.geteuid()} {path}"
        )
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077:
        raise ValueError(
            f"tenant secret file {path}: {_who(mode)} (mode {mode:04o}); whoever reads it can "
            f"compute every tenant's cache salt. Run: chmod 600 {path}"
        )


def _who(mode: int) -> str:
    """Which others may read or write a file of ``mode``, in words."""
    rights = []
    for name, shift in (("group", 3), ("others", 0)):
        can = [verb for verb, bit in (("read", 4), ("write", 2)) if mode >> shift & bit]
        if can:
            rights.append(f"{name} can {' and '.join(can)} it")
    return ", ".join(rights) or "others can execute it"


def _parse_lines(path: Path, data: bytes) -> TenantSecrets:
    """The current secret (first line) and a previous one (an optional second line)."""
    lines = [line for line in data.split(b"\n") if line.strip()]
    if not 1 <= len(lines) <= 2:
        raise ValueError(
            f"tenant secret file {path}: {len(lines)} lines; one secret, or two during a "
            f"rotation (the new one first, then the previous one){_hint(path)}"
        )
    secrets = [_parse(path, line, number) for number, line in enumerate(lines, start=1)]
    if len(secrets) == 2 and secrets[0] == secrets[1]:
        raise ValueError(f"tenant secret file {path}: line 2 repeats line 1 (nothing rotates)")
    return TenantSecrets(*secrets)


def _parse(path: Path, data: bytes, line: int = 1) -> bytes:
    """One secret: a line of hex, at least ``MIN_SECRET_BYTES``."""
    where = f"tenant secret file {path}" + (f", line {line}" if line > 1 else "")
    try:
        secret = bytes.fromhex(data.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        raise ValueError(f"{where}: not a hex string{_hint(path)}") from None
    if len(secret) < MIN_SECRET_BYTES:
        message = f"{len(secret)} bytes, at least {MIN_SECRET_BYTES} needed"
        raise ValueError(f"{where}: {message}{_hint(path)}")
    return secret


def _create_secret(path: Path) -> bytes:
    """A new random secret written to ``path`` (owner-only; never over an existing file)."""
    _make_private_folders(path.parent)
    secret = os.urandom(SECRET_BYTES)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(descriptor, "w") as file:
        os.fchmod(file.fileno(), 0o600)  # whatever the umask
        file.write(secret.hex() + "\n")
    return secret


def _make_private_folders(folder: Path) -> None:
    """Create ``folder`` and any missing parents as 0700 (whatever the umask)."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for new in reversed(missing):
        new.mkdir(mode=0o700)
        new.chmod(0o700)


def _hint(path: Path) -> str:
    """What a secret file holds and how to make one."""
    return (
        f"; expected {2 * SECRET_BYTES} hex digits ({SECRET_BYTES} bytes) on one line. Make one "
        f'with: python -c "import secrets; print(secrets.token_hex({SECRET_BYTES}))" > {path} '
        f"&& chmod 600 {path} (or name a path that does not exist, and prefixcache creates it "
        "there)"
    )
