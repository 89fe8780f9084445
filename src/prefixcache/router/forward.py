"""Forwarding one request to a replica: retry before the first byte, stream bytes unchanged.

A request is sent again, once, to another replica when nothing of it has reached the
client yet: the connection was refused or dropped, the replica died before answering, or
it answered 429. Once a stream has started, a failure ends it with an SSE error event
(and ``[DONE]`` on OpenAI's routes). Every response carries ``x-prefixcache-replica``.
Upstream events are forwarded whole (cut at a blank line), so a replica dying mid-event
never leaves half an event before the error. A request goes to the path of the route it
matched, never to a path the client spelled (no dot segments reach a replica). Replica
URLs go to the log and to that header, never into an error a client reads.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import anyio
import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from prefixcache.protocol.errors import ApiError, stream_error_event
from prefixcache.router.drain import ROUTER_SHUTTING_DOWN, Cut, Drain
from prefixcache.router.metrics import RouterMetrics
from prefixcache.router.replicas import Fleet, Replica, describe
from prefixcache.router.routing import Router, Ticket

log = logging.getLogger("prefixcache.router")

REPLICA_HEADER = "x-prefixcache-replica"
MAX_ATTEMPTS = 2  # the first replica, then one other
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
DISCONNECT_POLL_S = 0.5


class _Sent(NamedTuple):
    """What goes to each replica tried: the client's request, the route's path, the body."""

    request: Request
    path: str
    body: bytes
    stream: bool


class Retry(NamedTuple):
    """An attempt that sent nothing to the client: try another replica."""

    reason: str


@dataclass(slots=True)
class RouteLog:
    """What one log line says about a request: counts and URLs, never text or token ids."""

    endpoint: str
    prompt_tokens: int | None = None
    prompt_blocks: int = 0
    attempts: int = 0

    def emit(self, ticket: Ticket | None, status: str) -> None:
        choice = ticket.choice if ticket else None
        log.info(
            "route endpoint=%s replica=%s prompt_tokens=%s prompt_blocks=%d pool_blocks=%d "
            "tier_blocks=%d reason=%s attempts=%d status=%s",
            self.endpoint,
            ticket.url if ticket else "-",
            "-" if self.prompt_tokens is None else self.prompt_tokens,
            self.prompt_blocks,
            choice.overlap.pool_blocks if choice else 0,
            choice.overlap.tier_blocks if choice else 0,
            choice.reason if choice else "-",
            self.attempts,
            status,
        )


def forward_headers(request: Request) -> dict[str, str]:
    """The client's headers for the replica, Authorization included, unchanged."""
    return {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}


def response_headers(upstream: httpx.Response, replica: Replica, decoded: bool) -> dict[str, str]:
    """The replica's headers for the client (our server adds its own date), plus its URL and
    the headers its replicas-file entry gives (``x-prefixcache-node`` under Ray)."""
    drop = HOP_BY_HOP | {"date", "server"} | ({"content-encoding"} if decoded else frozenset())
    headers = {k: v for k, v in upstream.headers.items() if k.lower() not in drop}
    headers.update(replica.headers)
    headers[REPLICA_HEADER] = replica.url
    return headers


def error_event(message: str, path: str | None = None, status: int = 500) -> bytes:
    """An error as one SSE event in the route's shape (``stream_error_event``)."""
    return stream_error_event(status, message, path).encode()


class Forwarder:
    """Sends requests through the router's choice, with one retry and streaming relay."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        router: Router,
        fleet: Fleet,
        metrics: RouterMetrics,
        drain: Drain | None = None,
    ) -> None:
        self.client, self.router, self.fleet, self.metrics = client, router, fleet, metrics
        self.drain = drain or Drain()
        self._checks: set[asyncio.Task] = set()

    async def forward(
        self,
        request: Request,
        path: str,
        body: bytes,
        digests: Sequence[bytes],
        stream: bool,
        route: RouteLog,
        key: bytes | None = None,
        pinned: str | None = None,
    ) -> Response:
        """The replica's answer; 503 (in the route's error shape) when no replica could take
        it. ``key``: the request's affinity key (an opaque digest), if it has one; ``pinned``:
        the replica it must go to while that one is healthy (``Router.dispatch``)."""
        if self.drain.draining:
            raise ApiError(503, ROUTER_SHUTTING_DOWN)
        tried: list[str] = []
        reason: str | None = None  # None: no replica to try (then the fleet says why)
        for attempt in range(MAX_ATTEMPTS):
            ticket = self.router.dispatch(digests, exclude=tried, key=key, pinned=pinned)
            if ticket is None:
                break
            tried.append(ticket.url)
            route.attempts = attempt + 1
            can_retry = attempt + 1 < MAX_ATTEMPTS and self._another(tried)
            sent = _Sent(request, path, body, stream)
            outcome = await self._attempt(ticket, sent, route, can_retry)
            if not isinstance(outcome, Retry):
                return outcome
            reason = outcome.reason
            self.metrics.retries.labels(reason.split(":")[0]).inc()
        route.emit(None, "unavailable")
        self.metrics.requests.labels("none", route.endpoint, "503").inc()
        if reason is None:
            raise ApiError(503, self.fleet.unavailable_reason())
        log.warning("no replica could serve a request: tried %s", ", ".join(tried))
        message = f"no replica could serve the request ({len(tried)} tried, the last: {reason})"
        raise ApiError(503, message)

    def _another(self, tried: list[str]) -> bool:
        """Is there a healthy replica this request has not been sent to?"""
        return any(r.url not in tried for r in self.fleet.healthy())

    async def _attempt(
        self, ticket: Ticket, sent: _Sent, route: RouteLog, can_retry: bool
    ) -> Response | Retry:
        """One replica: a Response for the client, or Retry if nothing was sent."""
        request = sent.request
        upstream_request = self.client.build_request(
            request.method,
            ticket.url + sent.path,
            headers=forward_headers(request),
            content=sent.body,
        )
        try:
            upstream = await self.drain.unless_cut(self.client.send(upstream_request, stream=True))
        except httpx.TransportError as error:
            return self._failed(ticket, error)
        except Cut:
            raise self._cut(ticket, route) from None
        if upstream.status_code == 429 and can_retry:
            await upstream.aclose()
            self.router.release(ticket, ok=False)
            return Retry("HTTP 429")
        if sent.stream and upstream.status_code == 200:
            relay = self._relay(ticket, upstream, route, sent.path)
            headers = response_headers(upstream, ticket.replica, decoded=False)
            return StreamingResponse(relay, status_code=200, headers=headers)
        return await self._whole(ticket, upstream, request, route)

    async def _whole(
        self, ticket: Ticket, upstream: httpx.Response, request: Request, route: RouteLog
    ) -> Response | Retry:
        """A non-streamed answer, read in full (the client's disconnect closes the upstream)."""
        try:
            content = await self.drain.unless_cut(self._read_unless_gone(upstream, request))
        except httpx.TransportError as error:
            return self._failed(ticket, error)
        except Cut:
            raise self._cut(ticket, route) from None
        finally:
            await upstream.aclose()
        status = upstream.status_code
        ok = status < 400
        self.router.release(ticket, ok)
        self._record(ticket, route, str(status) if content is not None else "disconnected")
        if content is None:
            return Response(status_code=499)
        headers = response_headers(upstream, ticket.replica, decoded=True)
        return Response(content, status_code=status, headers=headers)

    async def _read_unless_gone(self, upstream: httpx.Response, request: Request) -> bytes | None:
        """The body; None if the client went away first (the replica then aborts the request)."""
        read = asyncio.ensure_future(upstream.aread())
        try:
            while not read.done():
                await asyncio.wait({read}, timeout=DISCONNECT_POLL_S)
                if not read.done() and await request.is_disconnected():
                    return None
            return read.result()
        finally:  # gone, or cut at the shutdown deadline: the read goes too
            if not read.done():
                read.cancel()
                await asyncio.wait({read})

    async def _relay(
        self, ticket: Ticket, upstream: httpx.Response, route: RouteLog, path: str
    ) -> AsyncIterator[bytes]:
        """The replica's SSE bytes as they come, whole events at a time; a failure ends cleanly."""
        status, pending = "disconnected", b""
        try:
            async for chunk in self.drain.chunks(upstream.aiter_raw()):
                pending += chunk
                cut = pending.rfind(b"\n\n") + 2
                if cut >= 2:
                    yield pending[:cut]
                    pending = pending[cut:]
            if pending:
                yield pending
            status = "200"
        except httpx.TransportError as error:
            status = "failed_mid_stream"
            self._schedule_check(ticket)
            log.warning("replica %s failed mid-stream: %s", ticket.url, describe(error))
            yield error_event(f"the replica failed mid-stream ({type(error).__name__})", path)
        except Cut:  # the replica is fine: this router is stopping
            status = "cut_at_shutdown"
            yield error_event(ROUTER_SHUTTING_DOWN, path, status=503)
        finally:
            self.router.release(ticket, ok=status in ("200", "cut_at_shutdown"))
            self._record(ticket, route, status)
            with anyio.CancelScope(shield=True):
                await upstream.aclose()

    def _failed(self, ticket: Ticket, error: httpx.TransportError) -> Retry:
        """Nothing reached the client: release, take the replica out or re-check it, retry."""
        self.router.release(ticket, ok=False)
        reason = describe(error)
        if isinstance(error, httpx.ConnectError):
            self.fleet.mark_down(ticket.replica, f"connection failed ({reason})")
        else:
            self._schedule_check(ticket)
        log.warning(
            "replica %s failed before answering: %s; retrying elsewhere", ticket.url, reason
        )
        return Retry(type(error).__name__)

    def _cut(self, ticket: Ticket, route: RouteLog) -> ApiError:
        """The deadline came before the replica's answer: release it; the 503 to raise."""
        self.router.release(ticket, ok=True)
        self._record(ticket, route, "cut_at_shutdown")
        return ApiError(503, ROUTER_SHUTTING_DOWN)

    @property
    def checks_running(self) -> int:
        """Health checks a failure scheduled that have not finished yet."""
        return len(self._checks)

    def _schedule_check(self, ticket: Ticket) -> None:
        """Health-check the replica now, not at the next tick (a dropped keep-alive is no death)."""
        task = asyncio.get_running_loop().create_task(self.fleet.check(ticket.replica))
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    def _record(self, ticket: Ticket, route: RouteLog, status: str) -> None:
        self.metrics.requests.labels(ticket.url, route.endpoint, status).inc()
        route.emit(ticket, status)
