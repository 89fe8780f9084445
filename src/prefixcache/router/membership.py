"""A replica list that another process rewrites: ``prefixcache route --replicas-file``.

``prefixcache ray`` places, restarts and scales the replicas, so their URLs change while
the router runs. Its ingress writes the live set to a JSON file (atomically, by rename)
and the router re-reads it at each health check when it changed::

    {"replicas": [{"url": "http://10.0.0.5:41234",
                   "headers": {"x-prefixcache-node": "<ray node id>"}}]}

``headers`` are added to every response the replica gives (names must start with
``x-prefixcache-``). A file that fails its checks is ignored, with the reason logged,
and the last good list stays.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import NamedTuple
from urllib.parse import urlsplit

log = logging.getLogger("prefixcache.router")

MAX_FILE_BYTES = 1 << 20
MAX_REPLICAS = 4096
HEADER_PREFIX = "x-prefixcache-"
MAX_HEADER_VALUE = 256


class Member(NamedTuple):
    """One replica in the file: its base URL and the headers its responses carry."""

    url: str
    headers: dict[str, str]


def parse_members(text: str) -> list[Member]:
    """The file's replicas; ValueError naming the field that is wrong."""
    body = json.loads(text)
    entries = body.get("replicas") if isinstance(body, dict) else None
    if not isinstance(entries, list):
        raise ValueError("'replicas' must be a list")
    if len(entries) > MAX_REPLICAS:
        raise ValueError(f"'replicas' has {len(entries)} entries, the limit is {MAX_REPLICAS}")
    return [_member(entry, number) for number, entry in enumerate(entries)]


def _member(entry: object, number: int) -> Member:
    where = f"replicas[{number}]"
    if not isinstance(entry, dict) or not isinstance(entry.get("url"), str):
        raise ValueError(f"{where}.url must be a string")
    url = entry["url"].rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{where}.url must be an http(s) URL with a host")
    headers = entry.get("headers", {})
    if not isinstance(headers, dict):
        raise ValueError(f"{where}.headers must be an object")
    for name, value in headers.items():
        if not name.lower().startswith(HEADER_PREFIX) or not name.isascii():
            raise ValueError(f"{where}.headers: {name!r} must start with {HEADER_PREFIX!r}")
        if not isinstance(value, str) or not value.isprintable() or len(value) > MAX_HEADER_VALUE:
            raise ValueError(
                f"{where}.headers[{name!r}] must be printable text of at most "
                f"{MAX_HEADER_VALUE} characters"
            )
    return Member(url, {name.lower(): value for name, value in headers.items()})


class MembershipFile:
    """Reads the file again only when its size or modification time changed."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._seen: tuple[int, int] | None = None

    def read_if_changed(self) -> list[Member] | None:
        """The new list, or None when unchanged, missing or refused (then logged once)."""
        try:
            status = self.path.stat()
        except OSError:
            return None  # not written yet: the writer has no replica ready
        stamp = (status.st_mtime_ns, status.st_size)
        if stamp == self._seen:
            return None
        self._seen = stamp
        try:
            if status.st_size > MAX_FILE_BYTES:
                raise ValueError(f"{status.st_size} bytes, the limit is {MAX_FILE_BYTES}")
            return parse_members(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:  # JSONDecodeError is a ValueError
            log.error("replicas file %s refused, the last list stays: %s", self.path, error)
            return None


def write_members(path: str | os.PathLike, members: list[Member]) -> None:
    """Write the list atomically (a reader sees the old file or the new one, never half)."""
    path = Path(path)
    body = {"replicas": [{"url": m.url, "headers": m.headers} for m in members]}
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(body), encoding="utf-8")
    os.replace(temporary, path)
