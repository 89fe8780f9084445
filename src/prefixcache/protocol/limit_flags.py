"""The flags of the HTTP front's limits, defined once for ``prefixcache serve`` and ``route``:
the same names, defaults and help on both (each limit: docs/tenants-and-limits.md)."""

from __future__ import annotations

import argparse

from prefixcache.argtypes import positive_int, positive_seconds
from prefixcache.protocol.limits import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_PENDING,
    DEFAULT_REQUEST_READ_TIMEOUT,
    Limits,
)


def add_limit_flags(parser: argparse.ArgumentParser) -> None:
    """``--max-pending``, ``--max-pending-per-tenant``, ``--max-body-bytes``,
    ``--request-read-timeout``."""
    parser.add_argument(
        "--max-pending",
        type=positive_int,
        default=DEFAULT_MAX_PENDING,
        help="requests in flight before new ones get HTTP 429",
    )
    parser.add_argument(
        "--max-pending-per-tenant",
        type=positive_int,
        help="requests one tenant may have in flight (HTTP 429 past it; default: half of "
        "--max-pending; only with --api-key-file)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=positive_int,
        default=DEFAULT_MAX_BODY_BYTES,
        help=f"largest request body, HTTP 413 (default {DEFAULT_MAX_BODY_BYTES})",
    )
    parser.add_argument(
        "--request-read-timeout",
        type=positive_seconds,
        default=DEFAULT_REQUEST_READ_TIMEOUT,
        metavar="SECONDS",
        help="a request's head, and then its body, must arrive within this long, or HTTP 408 "
        f"(default {DEFAULT_REQUEST_READ_TIMEOUT:g})",
    )


def limits_from(args: argparse.Namespace) -> Limits:
    """The ``Limits`` those flags set (``--max-pending`` stays ``args.max_pending``)."""
    return Limits(args.max_body_bytes, args.request_read_timeout, args.max_pending_per_tenant)
