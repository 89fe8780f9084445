"""Reading a request body under a size limit and a deadline, before any handler runs."""

from __future__ import annotations

import asyncio

from starlette.types import Message, Receive, Scope

from prefixcache.protocol.errors import ApiError


def declared_length(scope: Scope) -> int | None:
    """The ``Content-Length`` header (h11 has already refused a malformed one)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value)
    return None


def too_large(max_bytes: int) -> ApiError:
    return ApiError(413, f"request body is larger than {max_bytes} bytes (--max-body-bytes)")


async def read_body(scope: Scope, receive: Receive, max_bytes: int, timeout: float) -> bytes | None:
    """The whole body; None if the client went away. 413 past ``max_bytes`` (declared or
    received: a chunked or lying client is cut off at the limit), 408 after ``timeout`` s."""
    declared = declared_length(scope)
    if declared is not None and declared > max_bytes:
        raise too_large(max_bytes)
    try:
        async with asyncio.timeout(timeout):
            return await _collect(receive, max_bytes)
    except TimeoutError:
        raise ApiError(
            408, f"request body not received within {timeout:g} s (--request-read-timeout)"
        ) from None


async def _collect(receive: Receive, max_bytes: int) -> bytes | None:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise too_large(max_bytes)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives ``body`` once, then the client's own messages (disconnect)."""
    given = False

    async def receive_again() -> Message:
        nonlocal given
        if given:
            return await receive()
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive_again
