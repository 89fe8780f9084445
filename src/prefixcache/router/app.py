"""The router's FastAPI app: a replica's endpoints, answered by the best replica for each request.

The router checks API keys itself (the same key file as the replicas) and passes the
``Authorization`` header through unchanged, so each replica authenticates the request
again and derives the same tenant salt.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from prefixcache.engine.tokenizer import Tokenizer
from prefixcache.protocol.auth import AuthError, Tenant, Tenants
from prefixcache.protocol.errors import ApiError, answer_api_error, internal_error
from prefixcache.router.digests import prompt_digests
from prefixcache.router.feed import FeedStats
from prefixcache.router.forward import Forwarder, RouteLog
from prefixcache.router.index import GlobalIndex
from prefixcache.router.metrics import RouterMetrics
from prefixcache.router.policy import RoutingPolicy, make_policy
from prefixcache.router.prompts import RoutingView, routing_view
from prefixcache.router.replicas import (
    DEFAULT_HEALTH_INTERVAL_S,
    DEFAULT_HEALTH_TIMEOUT_S,
    ClusterNamespace,
    Fleet,
)
from prefixcache.router.routing import DEFAULT_EXPECT_GRACE_S, Router

log = logging.getLogger("prefixcache.router")
CONNECT_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 1024


@dataclass(slots=True)
class RouterConfig:
    """Everything ``create_router_app`` needs; the CLI fills it from flags."""

    replicas: list[str]
    policy: RoutingPolicy = field(default_factory=lambda: make_policy("cache-aware"))
    tenants: Tenants = field(default_factory=lambda: Tenants(None))
    tokenizer: Tokenizer | None = None  # required by policies that use digests
    health_interval_s: float = DEFAULT_HEALTH_INTERVAL_S
    health_timeout_s: float = DEFAULT_HEALTH_TIMEOUT_S
    expect_grace_s: float = DEFAULT_EXPECT_GRACE_S
    use_events: bool = True


@dataclass(slots=True)
class RouterState:
    """What the handlers share (``app.state.router``)."""

    config: RouterConfig
    index: GlobalIndex
    client: httpx.AsyncClient
    fleet: Fleet
    metrics: RouterMetrics
    router: Router
    forwarder: Forwarder

    @classmethod
    def build(cls, config: RouterConfig) -> RouterState:
        if config.policy.uses_digests and config.tokenizer is None:
            raise ValueError(f"policy {config.policy.name!r} needs a tokenizer")
        index = GlobalIndex()
        timeout = httpx.Timeout(None, connect=CONNECT_TIMEOUT_S)
        limits = httpx.Limits(max_connections=MAX_CONNECTIONS, max_keepalive_connections=64)
        client = httpx.AsyncClient(timeout=timeout, limits=limits)
        fleet = Fleet(
            config.replicas,
            index,
            client,
            health_timeout_s=config.health_timeout_s,
            use_events=config.use_events,
            metrics_headers=config.tenants.admin_headers(),
        )
        metrics = RouterMetrics(fleet)
        router = Router(fleet, index, config.policy, metrics, config.expect_grace_s)
        forwarder = Forwarder(client, router, fleet, metrics)
        return cls(config, index, client, fleet, metrics, router, forwarder)

    def authenticate(self, request: Request) -> Tenant:
        try:
            return self.config.tenants.authenticate(request.headers.get("authorization"))
        except AuthError as error:
            raise ApiError(401, str(error)) from None

    def namespace(self) -> ClusterNamespace:
        """The replicas' shared namespace; 503 (saying why) while no replica is healthy."""
        if self.fleet.namespace is None or not self.fleet.healthy():
            raise ApiError(503, self.fleet.unavailable_reason())
        return self.fleet.namespace

    def health(self) -> JSONResponse:
        """The router's view: up if any replica is, and every replica's state."""
        replicas = [
            {
                "url": r.url,
                "healthy": r.healthy,
                "in_flight": r.in_flight,
                "load": r.load,
                "index_blocks": self.index.counts(r.url)._asdict(),
                "kv_events": _feed_stats(r.feed.stats) if r.feed else None,
                "error": r.last_error,
                "load_error": r.load_error,
            }
            for r in self.fleet.replicas.values()
        ]
        up = bool(self.fleet.healthy())
        namespace = self.fleet.namespace
        body = {
            "status": "ok" if up else "unavailable",
            "policy": self.config.policy.name,
            "model": namespace.model if namespace else None,
            "block_size": namespace.block_size if namespace else None,
            "namespace_digest": namespace.root.hex() if namespace else None,
            "replicas": replicas,
        }
        if not up:
            body["detail"] = self.fleet.unavailable_reason()
        return JSONResponse(body, status_code=200 if up else 503)


def _feed_stats(stats: FeedStats) -> dict:
    """A feed's counters for /health."""
    return dataclasses.asdict(stats)


def create_router_app(config: RouterConfig) -> FastAPI:
    """The app; its lifespan checks every replica once, then keeps checking in the background."""
    state = RouterState.build(config)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await state.fleet.check_all()
        checks = asyncio.create_task(state.fleet.run(config.health_interval_s))
        try:
            yield
        finally:
            checks.cancel()
            with suppress(asyncio.CancelledError):
                await checks
            state.fleet.close()
            await state.client.aclose()

    app = FastAPI(title="prefixcache router", lifespan=lifespan)
    app.state.router = state
    app.add_exception_handler(ApiError, answer_api_error)
    app.add_exception_handler(Exception, internal_error)
    _add_routes(app, state)
    return app


def _add_routes(app: FastAPI, state: RouterState) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        return state.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        state.authenticate(request)
        state.namespace()
        return await state.forwarder.forward(request, b"", [], False, RouteLog("models"))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _complete(state, request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _complete(state, request, chat=False)


async def _complete(state: RouterState, request: Request, chat: bool) -> Response:
    """Authenticate, read what routing needs, hash the prompt, forward to the chosen replica."""
    tenant = state.authenticate(request)
    namespace = state.namespace()
    raw = await request.body()
    tokenizer = state.config.tokenizer if state.config.policy.uses_digests else None
    view = routing_view(raw, chat, tokenizer)
    digests = _digests(state, namespace, tenant, view)
    tokens = None if view.token_ids is None else len(view.token_ids)
    route = RouteLog("chat" if chat else "completions", tokens, len(digests))
    return await state.forwarder.forward(request, raw, digests, view.stream, route)


def _digests(
    state: RouterState, namespace: ClusterNamespace, tenant: Tenant, view: RoutingView
) -> list[bytes]:
    """The prompt's block digests under the tenant's salt; none if unknown or never reusable."""
    if view.token_ids is None or tenant.no_reuse:  # a no-reuse salt is random per request
        return []
    salt = state.config.tenants.cache_salt(tenant, view.cache_salt)
    try:
        return prompt_digests(namespace.root, namespace.block_size, view.token_ids, salt)
    except ValueError:  # an id past uint32: the replica will refuse the request itself
        return []
