"""The first thing every request meets: header limits, auth, then the body's size and deadline.

Auth is decided on the route the router will dispatch (Starlette's own matching over the
app's routes, on ``scope["path"]``), never on a URL rebuilt from the ``Host`` header, and
before the method is checked, so HEAD, OPTIONS, a trailing slash or ``//v1/...`` get a
401 or a 404, never an answer. A request to a metered route holds a unit of its tenant's
share from then until its response ends (429 past the share). The body is read whole (no
engine slot or replica is held meanwhile) and handed to the app as if it had just arrived;
a client that leaves before its body arrived costs one log line (no traceback) and a count.
The same guard fronts the server and the router (``protocol/front.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Receive, Scope, Send

from prefixcache.protocol.admission import InFlight, Ticket
from prefixcache.protocol.auth import MISSING_KEY, AuthError, Tenant, Tenants
from prefixcache.protocol.body_limit import read_body, replay
from prefixcache.protocol.errors import ApiError
from prefixcache.protocol.limits import MAX_HEADER_BYTES, MAX_HEADERS, Limits

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RoutePolicy:
    """Route paths (as declared): no key needed, admin key needed, engine work (metered)."""

    public: frozenset[str]
    admin: frozenset[str]
    metered: frozenset[str]


def dispatched_route(routes: list[BaseRoute], scope: Scope) -> BaseRoute | None:
    """The route Starlette's router will hand ``scope`` to: the first full match, else the
    first partial one (right path, wrong method: 405); None for a 404."""
    partial = None
    for route in routes:
        match, _ = route.matches(scope)
        if match is Match.FULL:
            return route
        if match is Match.PARTIAL and partial is None:
            partial = route
    return partial


def check_headers(scope: Scope) -> None:
    """431 for too many header fields or too many bytes of request line and headers."""
    headers = scope["headers"]
    if len(headers) > MAX_HEADERS:
        raise ApiError(431, f"{len(headers)} header fields; at most {MAX_HEADERS} allowed")
    size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
    size += sum(len(name) + len(value) + 4 for name, value in headers)
    if size > MAX_HEADER_BYTES:
        raise ApiError(431, f"request headers are {size} bytes; at most {MAX_HEADER_BYTES} allowed")


class RequestGuard:
    """ASGI middleware: 431, 401/403 by route, 429 past the tenant's share, 413/408 reading
    the body; then the app, with ``tenant`` and ``ticket`` in ``scope["state"]``."""

    def __init__(
        self, app: ASGIApp, *, routes: list[BaseRoute], tenants: Tenants, policy: RoutePolicy,
        limits: Limits, in_flight: InFlight, on_aborted_read: Callable[[], None] | None = None,
    ) -> None:  # fmt: skip
        self.app, self.routes, self.tenants = app, routes, tenants
        self.policy, self.limits, self.in_flight = policy, limits, in_flight
        self.on_aborted_read = on_aborted_read

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            check_headers(scope)
            tenant, path = self.authorize(scope)
            ticket = self.in_flight.enter(tenant.name) if path in self.policy.metered else None
        except ApiError as error:
            await _refuse(error, scope, receive, send)
            return
        try:
            await self._read_then_call(scope, receive, send, tenant, ticket, path)
        finally:
            if ticket is not None:
                self.in_flight.leave(ticket)

    async def _read_then_call(
        self, scope: Scope, receive: Receive, send: Send, tenant: Tenant | None,
        ticket: Ticket | None, path: str | None,
    ) -> None:  # fmt: skip
        limits = self.limits
        try:
            body = await read_body(
                scope, receive, limits.max_body_bytes, limits.request_read_timeout
            )
        except ApiError as error:
            await _refuse(error, scope, receive, send)
            return
        if body is None:
            self._aborted(scope, path)
            return
        scope.setdefault("state", {}).update(tenant=tenant, ticket=ticket)
        await self.app(scope, replay(body, receive), send)

    def _aborted(self, scope: Scope, path: str | None) -> None:
        """The client went away before its body arrived: one line (the route, not the
        client's path), and the count."""
        route = path or "(no route)"
        log.info("client left before its request body arrived: %s %s", scope["method"], route)
        if self.on_aborted_read is not None:
            self.on_aborted_read()

    def authorize(self, scope: Scope) -> tuple[Tenant | None, str | None]:
        """The dispatched route's path, and the tenant it needs (401/403); no tenant for a
        public route or a 404."""
        route = dispatched_route(self.routes, scope)
        path = getattr(route, "path", None)
        if route is None or path in self.policy.public:
            return None, path
        try:
            tenant = self.tenants.authenticate(presented_key(scope))
        except AuthError as error:
            raise ApiError(401, str(error)) from None
        if path in self.policy.admin and not tenant.admin:
            message = f"tenant {tenant.name!r} is not an admin: {path} needs an admin key"
            raise ApiError(403, message)
        return tenant, path


def presented_key(scope: Scope) -> str | None:
    """The request's ``Authorization`` header, or its ``x-api-key`` (Anthropic's clients) as
    a Bearer key; None if it has neither."""
    headers = dict(scope["headers"])
    authorization = headers.get(b"authorization", b"").decode("latin-1")
    if authorization:
        return authorization
    api_key = headers.get(b"x-api-key", b"").decode("latin-1")
    return f"Bearer {api_key}" if api_key else None


async def _refuse(error: ApiError, scope: Scope, receive: Receive, send: Send) -> None:
    """The error, on a connection closed after it (the rest of the body is never read)."""
    error.headers["Connection"] = "close"
    await error.response(scope.get("path"))(scope, receive, send)


def tenant_of(scope: Scope) -> Tenant:
    """The tenant the guard authenticated for this request; 401 if it did not (fail closed)."""
    tenant = scope.get("state", {}).get("tenant")
    if tenant is None:
        raise ApiError(401, MISSING_KEY)
    return tenant
