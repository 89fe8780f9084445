"""The router's FastAPI app: a replica's endpoints, answered by the best replica for each request.

It wears the replica's front (``protocol/front.py``): the same guard, limits, head deadline
and error objects. The router checks API keys itself (the same key file as the replicas)
and passes the ``Authorization`` header through unchanged, so each replica authenticates
the request again and derives the same tenant salt. Its routes are in ``router/routes.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field

import anyio
import httpx
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from prefixcache.engine.tokenizer import Tokenizer
from prefixcache.protocol import openapi
from prefixcache.protocol.admission import InFlight, export_pending
from prefixcache.protocol.auth import Tenants
from prefixcache.protocol.errors import ApiError
from prefixcache.protocol.front import install_front
from prefixcache.protocol.limits import DEFAULT_MAX_PENDING, PREPARE_THREADS, Limits
from prefixcache.router.affinity import DEFAULT_MAX_KEYS, KeyAffinity
from prefixcache.router.drain import Drain
from prefixcache.router.feed import FeedStats
from prefixcache.router.forward import Forwarder
from prefixcache.router.index import GlobalIndex
from prefixcache.router.membership import MembershipFile
from prefixcache.router.metrics import RouterMetrics
from prefixcache.router.policy import RoutingPolicy, make_policy
from prefixcache.router.replicas import (
    DEFAULT_HEALTH_INTERVAL_S,
    DEFAULT_HEALTH_TIMEOUT_S,
    ClusterNamespace,
    Fleet,
)
from prefixcache.router.routes import ROUTES, add_routes
from prefixcache.router.routing import DEFAULT_EXPECT_GRACE_S, Router

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
    limits: Limits = field(default_factory=Limits)  # the front's, as on a replica
    max_pending: int = DEFAULT_MAX_PENDING
    affinity_keys: int = DEFAULT_MAX_KEYS  # prompt_cache_keys remembered; 0: no key affinity
    replicas_file: str | None = None  # a list another process rewrites (prefixcache ray)


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
    in_flight: InFlight  # --max-pending, --max-pending-per-tenant (429)
    views: anyio.CapacityLimiter  # bodies parsed and tokenized at once, off the event loop

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
            membership=MembershipFile(config.replicas_file) if config.replicas_file else None,
        )
        metrics = RouterMetrics(fleet)
        affinity = None
        if config.affinity_keys > 0:
            affinity = KeyAffinity.for_policy(config.policy, config.affinity_keys)
        router = Router(fleet, index, config.policy, metrics, config.expect_grace_s, affinity)
        forwarder = Forwarder(client, router, fleet, metrics, Drain())
        tenants = config.tenants
        share = None if tenants.local else config.limits.tenant_share(config.max_pending)
        in_flight = InFlight(config.max_pending, share)
        export_pending(in_flight, metrics.registry, "prefixcache_router_pending")
        views = anyio.CapacityLimiter(PREPARE_THREADS)
        return cls(config, index, client, fleet, metrics, router, forwarder, in_flight, views)

    def model_name(self) -> str | None:
        """The model the replicas serve; None until one has answered a health check."""
        return None if self.fleet.namespace is None else self.fleet.namespace.model

    def namespace(self) -> ClusterNamespace:
        """The replicas' shared namespace; 503 (saying why) while no replica is healthy."""
        if self.fleet.namespace is None or not self.fleet.healthy():
            raise ApiError(503, self.fleet.unavailable_reason())
        return self.fleet.namespace

    def replica_states(self, with_addresses: bool) -> list[dict]:
        """Each replica's state, by position; its URL and last errors only if asked (admin)."""
        states = []
        for number, r in enumerate(self.fleet.replicas.values()):
            state = {
                "replica": number,
                "healthy": r.healthy,
                "in_flight": r.in_flight,
                "load": r.load,
                "prefill_tokens_pending": r.pending_prefill,
                "index_blocks": self.index.counts(r.url)._asdict(),
                "kv_events": _feed_stats(r.feed.stats) if r.feed else None,
            }
            if with_addresses:
                state.update(url=r.url, error=r.last_error, load_error=r.load_error)
            states.append(state)
        return states

    def health(self) -> JSONResponse:
        """The router's view, public: up if any replica is; replicas by position, no URLs."""
        replicas = self.replica_states(with_addresses=False)
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
        state.forwarder.drain.attach()
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

    app = FastAPI(title="prefixcache router", lifespan=lifespan, redirect_slashes=False)
    app.state.router = state
    add_routes(app, state)
    openapi.install(app, openapi.REQUEST_BODIES, state.model_name)
    install_front(
        app, app.router.routes, config.tenants, ROUTES, config.limits, state.in_flight,
        on_aborted_read=state.metrics.aborted_reads.inc,
    )  # fmt: skip
    return app
