"""uvicorn's h11 protocol with a deadline for each request head, and error objects for bad HTTP.

uvicorn waits for a request head forever: a client that sends one byte a second (slowloris)
or connects and says nothing holds its connection open. Here every head must be complete
within the read timeout of its first byte (or of the connection), or it gets a 408 and the
connection is closed. The body's own deadline is the guard's (``protocol/body_limit.py``).
"""

from __future__ import annotations

import asyncio
import http

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from prefixcache.protocol.errors import error_bytes
from prefixcache.protocol.limits import MAX_HEADER_BYTES


class GuardedH11Protocol(H11Protocol):
    """H11Protocol plus the request head deadline; malformed HTTP gets a JSON 400 (or 431)."""

    read_timeout: float = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and self._head_timer is None:
            self._arm()  # the first byte of the next request head on a kept-alive connection
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """h11 refused the request: a head over its size limit is a 431, the rest a 400."""
        if len(self.conn.trailing_data[0]) > MAX_HEADER_BYTES:
            self._refuse(431, f"request headers are over {MAX_HEADER_BYTES} bytes")
        else:
            self._refuse(400, f"malformed HTTP request: {msg}")

    def _arm(self) -> None:
        self._head_timer = self.loop.call_later(self.read_timeout, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            message = (
                f"request head not received within {self.read_timeout:g} s (--request-read-timeout)"
            )
            self._refuse(408, message)

    def _refuse(self, status: int, message: str) -> None:
        """Write an error response by hand (h11 cannot answer a request it never parsed)."""
        body = error_bytes(status, message)
        head = (
            f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n"
            "content-type: application/json\r\n"
            f"content-length: {len(body)}\r\n"
            "connection: close\r\n\r\n"
        )
        self.transport.write(head.encode() + body)
        self.transport.close()


def guarded_protocol(read_timeout: float) -> type[GuardedH11Protocol]:
    """The protocol class for one server's ``--request-read-timeout``."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"read_timeout": read_timeout})
