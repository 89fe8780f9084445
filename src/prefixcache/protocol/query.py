"""Query parameters the admin and Responses routes share."""

from __future__ import annotations

from prefixcache.protocol.errors import ApiError


def query_limit(value: str | None, default: int, maximum: int) -> int:
    """``limit`` from a query string: ``default`` if absent, else an integer from 1 to
    ``maximum``; a 400 naming that range otherwise."""
    if value is None:
        return default
    digits = value.isascii() and value.isdigit() and len(value) <= len(str(maximum))
    if not digits or not 1 <= int(value) <= maximum:
        raise ApiError(400, f"limit: must be an integer from 1 to {maximum}", "limit")
    return int(value)
