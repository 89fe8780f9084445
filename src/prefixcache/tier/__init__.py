"""Second-level KV block store ("tier"), keyed by the portable 32-byte chain digest.

Bytes only: the engine turns KV tensors into payload bytes and back (``BlockFormat``).
``open_tier("disk:/var/cache/kv", fmt)`` or ``open_tier("redis://host:6379/0", fmt)``
gives the ``TierClient`` the engine calls.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote_plus, urlsplit

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

if TYPE_CHECKING:
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


def __getattr__(name: str) -> object:
    """``RedisTier`` imported when first asked for: redis-py is ~0.1 s of every start-up,
    and most servers have no Redis tier."""
    if name == "RedisTier":
        from prefixcache.tier.redis_tier import RedisTier

        return RedisTier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


ACCEPTED_FORMS = (
    "disk:PATH, redis://HOST:PORT/DB, redis://USER:PASSWORD@HOST:PORT/DB, "
    "rediss://USER:PASSWORD@HOST:PORT/DB?ssl_ca_certs=CA.pem, redis+cluster://HOST:PORT"
)
# Query parameters of a Redis URL that redis-py's from_url passes on and the tier accepts;
# the TLS ones only with rediss://. Any other name is refused (redis-py would fail later, on
# every call, with an error that only the debug log shows).
TLS_FILES = {
    "ssl_ca_certs": "file",
    "ssl_certfile": "file",
    "ssl_keyfile": "file",
    "ssl_ca_path": "folder",
}
TLS_QUERY = frozenset({*TLS_FILES, "ssl_cert_reqs", "ssl_check_hostname", "ssl_password"})
CONNECTION_QUERY = frozenset(
    {"socket_timeout", "socket_connect_timeout", "socket_keepalive", "health_check_interval"}
)
SHOWN_QUERY = (TLS_QUERY | CONNECTION_QUERY) - {"ssl_password"}  # values redact() prints
CERT_REQS = ("required", "optional", "none")
BOOL_QUERY = frozenset({"ssl_check_hostname", "socket_keepalive"})
BOOLS = ("true", "false", "yes", "no", "1", "0")  # redis-py reads any other word as true
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
    """The spec without its password (user info, query, a malformed port), for messages.

    Everything before the last ``@`` is user info (a password may hold ``/``, ``?`` or ``@``
    unescaped): only a user name before ``:`` is kept. Query values are shown only for the
    names in ``SHOWN_QUERY``, and a port only if it is a number.
    """
    scheme, sep, rest = spec.partition("://")
    if not sep:
        return spec
    userinfo, at, rest = rest.rpartition("@")
    if at:
        user, colon, _ = userinfo.partition(":")
        userinfo = f"{user}:***@" if colon else "***@"
    cut = min((index for index in map(rest.find, "/?#") if index >= 0), default=len(rest))
    authority, tail = rest[:cut], rest[cut:]
    host, colon, port = authority.rpartition(":")
    if colon and not port.isdigit() and not authority.endswith("]"):
        authority = f"{host}:***"
    tail, hashed, _ = tail.partition("#")
    path, question, query = tail.partition("?")
    pieces = []
    for piece in query.split("&") if question else ():
        name, equals, _ = piece.partition("=")
        shown = unquote_plus(name) in SHOWN_QUERY
        pieces.append(piece if shown else f"{name}=***" if equals else "***")
    query = question + "&".join(pieces)
    return f"{scheme}://{userinfo}{authority}{path}{query}{'#***' if hashed else ''}"


def _bad_spec(spec: str, why: str) -> ValueError:
    return ValueError(f"tier spec {redact(spec)!r}: {why}; accepted forms: {ACCEPTED_FORMS}")


def _check_redis_url(spec: str, url: str, cluster: bool) -> None:
    """Reject a Redis URL without a host, with a bad port, naming a bad database, or with
    query parameters the tier does not take or values redis-py would refuse."""
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
    _check_query(spec, parts.query, tls=parts.scheme == "rediss")
    from redis.connection import parse_url  # here: see __getattr__

    try:
        parse_url(url)  # redis-py's own parse: a bad socket_timeout, ssl_check_hostname, ...
    except ValueError as error:
        raise _bad_spec(spec, str(error).rstrip(".")) from None


def _check_query(spec: str, query: str, tls: bool) -> None:
    """Refuse query parameters the tier does not pass on, TLS ones without rediss://, and
    TLS files that are not there (a bare piece without ``=`` is never echoed)."""
    accepted = CONNECTION_QUERY | TLS_QUERY if tls else CONNECTION_QUERY
    for piece in filter(None, query.split("&")):
        name, equals, value = (unquote_plus(part) for part in piece.partition("="))
        if not equals:
            raise _bad_spec(spec, "a query piece without '='")
        if name not in accepted:
            if name in TLS_QUERY:
                raise _bad_spec(spec, f"{name} needs TLS: use rediss://")
            known = ", ".join(sorted(CONNECTION_QUERY | TLS_QUERY))
            raise _bad_spec(spec, f"unknown query parameter {name!r} (known: {known})")
        kind = TLS_FILES.get(name)
        there = Path(value).is_file() if kind == "file" else Path(value).is_dir()
        if kind is not None and not there:
            raise _bad_spec(spec, f"{name}: no such {kind} {value!r}")
        if name in BOOL_QUERY and value.lower() not in BOOLS:
            raise _bad_spec(spec, f"{name} {value!r} is not one of {', '.join(BOOLS)}")
        if name == "ssl_cert_reqs" and value not in CERT_REQS:
            raise _bad_spec(spec, f"ssl_cert_reqs {value!r} is not one of {', '.join(CERT_REQS)}")


def _backend(spec: str, options: dict[str, Any]) -> KVTier:
    if spec.startswith("disk:"):
        path = spec.removeprefix("disk:")
        if not path:
            raise _bad_spec(spec, "no path")
        return DiskTier(path, options.pop("max_bytes", DEFAULT_DISK_MAX_BYTES), **options)
    scheme, sep, rest = spec.partition("://")
    from prefixcache.tier.redis_tier import RedisTier

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
