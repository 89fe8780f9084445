"""Second-level KV block store ("tier"), keyed by the portable 32-byte chain digest.

Bytes only: the engine turns KV tensors into payload bytes and back (``BlockFormat``).
``open_tier("disk:/var/cache/kv", fmt)`` or ``open_tier("redis://host:6379/0", fmt)``
gives the ``TierClient`` the engine calls.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

from prefixcache.tier.base import (
    REJECT_REASONS,
    BlockFormat,
    KVTier,
    TierError,
    TierStats,
    TierValueError,
)
from prefixcache.tier.client import CircuitBreaker, TierClient
from prefixcache.tier.codec import decode_value, encode_value, read_header
from prefixcache.tier.disk import DiskTier
from prefixcache.tier.redis_tier import RedisTier

__all__ = [
    "REJECT_REASONS",
    "BlockFormat",
    "CircuitBreaker",
    "DiskTier",
    "KVTier",
    "RedisTier",
    "TierClient",
    "TierError",
    "TierStats",
    "TierValueError",
    "decode_value",
    "encode_value",
    "open_tier",
    "read_header",
    "redact",
]

DEFAULT_DISK_MAX_BYTES = 4 << 30
ACCEPTED_FORMS = (
    "disk:PATH, redis://HOST:PORT/DB, rediss://:PASSWORD@HOST:PORT/DB, redis+cluster://HOST:PORT"
)
CLIENT_OPTIONS = frozenset(
    {
        "failure_threshold",
        "cooldown_seconds",
        "max_cooldown_seconds",
        "queue_blocks",
        "clock",
        "fetch_threads",
    }
)


def redact(spec: str) -> str:
    """The spec without its password, for error messages."""
    return re.sub(r"(://[^/@]*?:)[^/@]*@", r"\1***@", spec)


def _bad_spec(spec: str, why: str) -> ValueError:
    return ValueError(f"tier spec {redact(spec)!r}: {why}; accepted forms: {ACCEPTED_FORMS}")


def _check_redis_url(spec: str, url: str, cluster: bool) -> None:
    """Reject a Redis URL without a host, with a bad port, or naming a bad database."""
    parts = urlsplit(url)
    try:
        parts.port  # noqa: B018 (raises ValueError on a bad port)
    except ValueError:
        raise _bad_spec(spec, "bad port") from None
    if not parts.hostname:
        raise _bad_spec(spec, "no host")
    db = parts.path.strip("/")
    if db and not db.isdigit():
        raise _bad_spec(spec, f"database {db!r} is not a number")
    if cluster and db not in ("", "0"):
        raise _bad_spec(spec, "Redis Cluster has database 0 only")


def _backend(spec: str, options: dict[str, Any]) -> KVTier:
    if spec.startswith("disk:"):
        path = spec.removeprefix("disk:")
        if not path:
            raise _bad_spec(spec, "no path")
        return DiskTier(path, options.pop("max_bytes", DEFAULT_DISK_MAX_BYTES), **options)
    scheme, sep, rest = spec.partition("://")
    if sep and scheme in ("redis", "rediss"):
        _check_redis_url(spec, spec, cluster=False)
        return RedisTier(spec, **options)
    if sep and scheme in ("redis+cluster", "rediss+cluster"):
        url = f"{scheme.removesuffix('+cluster')}://{rest}"
        _check_redis_url(spec, url, cluster=True)
        return RedisTier(url, cluster=True, **options)
    raise _bad_spec(spec, "unknown scheme")


def open_tier(spec: str, fmt: BlockFormat, **options: Any) -> TierClient:
    """A ``TierClient`` over the backend ``spec`` names; ValueError lists the accepted forms.

    Options meant for ``TierClient`` (``failure_threshold``, ``queue_blocks``, ...) go to
    it, the rest to the backend (``max_bytes`` for disk, ``ttl_seconds`` for Redis, ...).
    """
    client_options = {k: v for k, v in options.items() if k in CLIENT_OPTIONS}
    backend_options = {k: v for k, v in options.items() if k not in CLIENT_OPTIONS}
    backend = _backend(spec, backend_options)
    try:
        return TierClient(backend, fmt, **client_options)
    except BaseException:
        backend.close()
        raise
