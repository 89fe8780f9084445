"""The FastAPI application: OpenAI endpoints (and Anthropic's Messages API) over the async
engine, per-tenant salts.

Every request passes ``guard.RequestGuard`` first (headers, auth by route, tenant share,
body size and deadline); bodies are then prepared in ``PreparePool`` threads
(``server/prepare.py``), so the event loop only routes, admits and streams.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from starlette.types import Receive, Scope, Send

from prefixcache.cache.retention import Keep
from prefixcache.engine.async_engine import AddRequest, AsyncLLMEngine, RequestStream
from prefixcache.engine.engine import LLMEngine
from prefixcache.engine.request import RequestOutput
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.protocol import openapi
from prefixcache.protocol.access_log import waited_field
from prefixcache.protocol.admission import InFlight, Ticket, export_pending
from prefixcache.protocol.anthropic_schemas import MessagesRequest
from prefixcache.protocol.auth import Tenant, Tenants
from prefixcache.protocol.cache_controls import CACHE_KEY_LOG_CHARS, openai_keeps
from prefixcache.protocol.errors import ApiError
from prefixcache.protocol.front import get_and_head, install_front, uvicorn_config
from prefixcache.protocol.guard import RoutePolicy, tenant_of
from prefixcache.protocol.limits import DEFAULT_MAX_PENDING, PREPARE_THREADS, Limits
from prefixcache.protocol.openapi import json_body, responses
from prefixcache.protocol.responses_schemas import ResponsesRequest
from prefixcache.protocol.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    PromptCacheFields,
)
from prefixcache.protocol.stopping_server import StoppingServer
from prefixcache.server import anthropic_format, openai_format
from prefixcache.server.cache_routes import PREFIXES, add_cache_routes
from prefixcache.server.events import KVEventPublisher
from prefixcache.server.fan_in import FanIn, failure_event
from prefixcache.server.lookup_routes import LOOKUP_PATHS, add_stored_routes, add_token_routes
from prefixcache.server.messages import prepare_messages
from prefixcache.server.metrics import ServerMetrics
from prefixcache.server.prepare import (
    PrepareContext,
    Prepared,
    max_prompt_chars,
    no_such_model,
    prepare_chat,
    prepare_completion,
)
from prefixcache.server.prepare_pool import PreparePool
from prefixcache.server.recent_requests import (
    REQUESTS,
    RecentRequests,
    add_request_routes,
    request_record,
)
from prefixcache.server.response_store import ResponseStore
from prefixcache.server.responses_api import prepare_responses

log = logging.getLogger("prefixcache.server")
SHUTTING_DOWN = "the server is shutting down; retry on another replica"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MESSAGES, RESPONSES = "/v1/messages", "/v1/responses"
ROUTES = RoutePolicy(
    public=frozenset({"/health"}),
    admin=frozenset({"/metrics", "/admin/reset_prefix_cache", PREFIXES, REQUESTS}),
    metered=frozenset({CHAT, COMPLETIONS, MESSAGES, RESPONSES, *LOOKUP_PATHS}),
)


@dataclass(slots=True)
class Server:
    """What the handlers share."""

    async_engine: AsyncLLMEngine
    model_name: str
    tenants: Tenants
    metrics: ServerMetrics
    limits: Limits
    prepare: PrepareContext
    in_flight: InFlight  # the global and per-tenant in-flight limits (429)
    pool: PreparePool = field(default_factory=lambda: PreparePool(PREPARE_THREADS))
    identity: dict = field(default_factory=dict)  # see replica_identity
    responses: ResponseStore = field(default_factory=ResponseStore)  # previous_response_id
    recent: RecentRequests = field(default_factory=RecentRequests)  # /admin/requests/{id}
    draining: bool = False  # shutting down: new requests get 503

    @property
    def engine(self) -> LLMEngine:
        """The synchronous engine the async one steps (read it only from the engine thread)."""
        return self.async_engine.engine


def create_app(
    engine: LLMEngine,
    tenants: Tenants,
    model_name: str,
    max_pending: int = DEFAULT_MAX_PENDING,
    publisher: KVEventPublisher | None = None,
    limits: Limits | None = None,
) -> FastAPI:
    """The app; its lifespan starts and stops the engine thread (and the event publisher)."""
    limits = limits or Limits()
    share = None if tenants.local else limits.tenant_share(max_pending)
    server = Server(
        AsyncLLMEngine(engine),
        model_name,
        tenants,
        ServerMetrics(engine, model_name),
        limits,
        prepare_context(engine, model_name),
        InFlight(max_pending, share),
    )
    server.identity = replica_identity(engine, publisher)
    export_pending(server.in_flight, server.metrics.registry, "prefixcache_requests_pending")

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        server.async_engine.start()
        yield
        server.async_engine.shutdown()  # its last events are queued to the publisher
        if publisher is not None:
            publisher.close()  # after the last batch
        server.pool.close()

    app = FastAPI(title="prefixcache", lifespan=lifespan, redirect_slashes=False)
    app.state.server = server
    app.state.kv_events = publisher  # /health reads whether its events are up
    if publisher is not None:
        server.metrics.registry.register(publisher.collector())
    _add_routes(app, server)
    openapi.install(app, openapi.REQUEST_BODIES, lambda: model_name)
    install_front(app, app.router.routes, tenants, ROUTES, limits, server.in_flight)
    return app


def prepare_context(engine: LLMEngine, model_name: str) -> PrepareContext:
    """What request preparation needs from the engine, read once."""
    context = engine.max_model_len
    return PrepareContext(
        engine.tokenizer,
        model_name,
        context,
        engine.model_config.vocab_size,
        max_prompt_chars(engine.tokenizer, context),
        engine.manager.block_size,
    )


def replica_identity(engine: LLMEngine, publisher: KVEventPublisher | None) -> dict:
    """Block size, namespace digest, KV dtype, decode activations, tier medium and event
    endpoints (no tenant data)."""
    events = None
    if publisher is not None:
        events = {
            "endpoint": publisher.endpoint,
            "replay": publisher.replay_endpoint,
            "topic": publisher.topic,
        }
    return {
        "block_size": engine.manager.block_size,
        "namespace_digest": engine.manager.root_digest.hex(),
        "kv_cache_dtype": engine.kv_cache_dtype,
        "decode_activations": engine.config.decode_activations,
        "tier": None if engine.tier is None else engine.tier.client.medium,
        "kv_events": events,
    }


def _add_routes(app: FastAPI, server: Server) -> None:
    @get_and_head(app, "/health", responses=responses(openapi.Health))
    async def health() -> dict:
        """Liveness, and what a router needs to compute this replica's digests."""
        publisher = app.state.kv_events  # events up or down: the replica serves either way
        live = {} if publisher is None else {"kv_events": publisher.health()}
        instance = server.responses.instance  # the prefix of its response ids (a router's map)
        identity = {**server.identity, "instance": instance}
        return {"status": "ok", "model": server.model_name, **identity, **live}

    @get_and_head(app, "/metrics", responses=openapi.plain_text(responses(None, 401, 403)))
    async def metrics() -> Response:
        """Prometheus metrics; with an API key file, for admin keys only."""
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_PLAIN_0_0_4)

    @get_and_head(app, "/v1/models", responses=responses(openapi.ModelList, 401))
    async def models() -> dict:
        return {"object": "list", "data": [_model_card(server)]}

    @get_and_head(
        app,
        "/v1/models/{model_id:path}",
        responses=responses(openapi.ModelCard, 401, 404),
    )
    async def model(model_id: str) -> dict:
        if model_id != server.model_name:
            raise ApiError(404, no_such_model(model_id, server.model_name), "model")
        return _model_card(server)

    engine_statuses = (401, 404, 429, 503)

    @app.post(
        CHAT,
        openapi_extra=json_body(ChatCompletionRequest),
        responses=responses(openapi.ChatCompletion, *engine_statuses, stream=True),
    )
    async def chat(request: Request) -> Response:
        return await _serve(server, request, prepare_chat)

    @app.post(
        COMPLETIONS,
        openapi_extra=json_body(CompletionRequest),
        responses=responses(openapi.Completion, *engine_statuses, stream=True),
    )
    async def completions(request: Request) -> Response:
        return await _serve(server, request, prepare_completion)

    @app.post(
        MESSAGES,
        openapi_extra=json_body(MessagesRequest),
        responses=responses(openapi.Message, *engine_statuses, stream=True, anthropic=True),
    )
    async def messages(request: Request) -> Response:
        """Anthropic's Messages API; ``cache_control`` breakpoints keep prompt prefixes."""
        return await _serve(server, request, prepare_messages, ANTHROPIC)

    @app.post(
        RESPONSES,
        openapi_extra=json_body(ResponsesRequest),
        responses=responses(None, *engine_statuses, stream=True),
    )
    async def create_response(request: Request) -> Response:
        """OpenAI's Responses API (a subset: docs/api.md)."""
        view = server.responses.view(tenant_of(request.scope).name)
        prepare = partial(prepare_responses, view=view)
        return await _serve(server, request, prepare, in_thread=True)

    @app.post("/admin/reset_prefix_cache", responses=responses(openapi.ResetReport, 401, 403))
    async def reset() -> dict:
        """Drop every cached block, if none is in use (admin keys only)."""
        return await server.async_engine.run_in_engine(_reset_report)

    add_token_routes(app, server)
    add_stored_routes(app, server)
    add_cache_routes(app, server)
    add_request_routes(app, server)


def _model_card(server: Server) -> dict:
    return {"id": server.model_name, "object": "model", "created": 0, "owned_by": "prefixcache"}


def _reset_report(engine: LLMEngine) -> dict:
    """Reset if nothing is in use; say honestly what happened either way."""
    in_use = engine.manager.num_blocks - engine.manager.num_free_blocks
    if engine.manager.reset():
        return {"reset": True, "detail": "all cached blocks dropped"}
    return {
        "reset": False,
        "detail": f"{in_use} blocks are in use by "
        f"{len(engine.scheduler.running)} running requests; nothing was dropped",
    }


@dataclass(frozen=True, slots=True)
class _Answer:
    """How a route answers: its whole response, and its SSE events."""

    full: Callable[[Prepared, list[RequestOutput]], dict]
    stream: Callable[[Prepared, FanIn, Callable], AsyncIterator[str]]


def _openai_stream(ready: Prepared, fan_in: FanIn, done: Callable) -> AsyncIterator[str]:
    """Chat, completions and responses: the shape's own stream formatter, as SSE."""
    options = getattr(ready.body, "stream_options", None)
    include_usage = bool(options and options.include_usage)
    formatter = ready.shape.stream_formatter(len(ready.prompts))
    return _sse(fan_in, formatter, include_usage, done)


OPENAI = _Answer(lambda ready, finals: ready.shape.respond(finals), _openai_stream)
ANTHROPIC = _Answer(
    lambda ready, finals: anthropic_format.response(ready.shape, finals),
    lambda ready, fan_in, done: anthropic_format.events(ready.shape, fan_in, done),
)


async def _serve(
    server: Server,
    request: Request,
    prepare: Callable[[bytes, PrepareContext], Prepared],
    answer: _Answer = OPENAI,
    in_thread: bool = False,
) -> Response:
    """Prepare the body off the loop, admit it, run it (one engine request per prompt)."""
    tenant = tenant_of(request.scope)
    ticket: Ticket = request.scope["state"]["ticket"]
    if server.draining:
        raise ApiError(503, SHUTTING_DOWN)
    raw = await request.body()
    if server.draining:  # the signal came while the body did: not started yet
        raise ApiError(503, SHUTTING_DOWN)
    if in_thread:  # it reads this process's state (the stored responses)
        ready = await server.pool.run(prepare, raw, server.prepare)
    else:
        ready = await server.pool.prepare(prepare, raw, server.prepare)
    prompts, body, shape = ready.prompts, ready.body, ready.shape
    priority = _priority(tenant, body)  # refused before it takes a place in flight
    server.in_flight.admit(ticket, len(prompts), server.async_engine.num_pending)
    salt = server.tenants.cache_salt(tenant, body.cache_salt)
    previous = server.tenants.previous_cache_salt(tenant, body.cache_salt)
    controls = _Controls(priority=priority)  # Messages has no OpenAI cache fields
    if isinstance(body, PromptCacheFields):
        key_id = server.tenants.cache_key_id(tenant, body.prompt_cache_key)
        controls = _Controls(body.prompt_cache_retention, key_id, priority)
    fan_in = await _open(server, tenant, ready, (salt, previous), controls)
    done = _Done(
        server, tenant, salt, shape.request_id, shape.endpoint, controls.cache_key, priority
    )
    if body.stream:
        return _Stream(answer.stream(ready, fan_in, done), lambda: done.once(fan_in))
    try:
        finals = await _until_finished(fan_in, request, done)
    except RuntimeError:
        if not server.draining:
            raise
        raise ApiError(503, "the server shut down before this request finished") from None
    except asyncio.CancelledError:
        if not server.draining:
            raise
        asyncio.current_task().uncancel()  # handled: answer 503 instead of a dropped socket
        raise ApiError(503, "the server shut down before this request finished") from None
    if finals is None:
        return Response(status_code=499)  # nobody is listening
    return JSONResponse(answer.full(ready, finals))


class _Stream(StreamingResponse):
    """An SSE response whose request is closed however the response ends, even if the
    client left before its first event (then the event generator never started)."""

    def __init__(self, events: AsyncIterator[str], on_end: Callable[[], None]) -> None:
        super().__init__(
            events, media_type="text/event-stream", headers=openai_format.STREAM_HEADERS
        )
        self.on_end = on_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_end()


async def _open(
    server: Server,
    tenant: Tenant,
    ready: Prepared,
    salts: tuple[str, str | None],
    controls: _Controls,
) -> FanIn:
    """Put every prompt in the engine together (so they share their prefix); 400 if refused.

    ``salts``: the request's cache salt, and its salt under a previous secret (rotation).
    """
    shape, prompts = ready.shape, ready.prompts
    adds = [
        _add_request(
            shape, i, len(prompts), p, ready.params, salts, tenant, controls, ready.retention
        )
        for i, p in enumerate(prompts)
    ]
    opened = await asyncio.gather(
        *(server.async_engine.open(add) for add in adds), return_exceptions=True
    )
    streams = [s for s in opened if isinstance(s, RequestStream)]
    failure = next((e for e in opened if isinstance(e, BaseException)), None)
    if failure is not None:
        for stream in streams:
            stream.close()
        if isinstance(failure, ValueError):  # the engine refused it: too long, bad token id
            param = shape.prompt_field
            raise ApiError(400, str(failure), param) from None
        raise failure
    return FanIn(streams)


def _add_request(
    shape: openai_format.Shape,
    index: int,
    count: int,
    prompt: list[int],
    params: SamplingParams,
    salts: tuple[str, str | None],
    tenant: Tenant,
    controls: _Controls,
    retention: tuple[Keep, ...] = (),
) -> AddRequest:
    """Prompt ``index`` of ``count`` as an engine request (ids ``<id>-<index>`` for a batch)."""
    return AddRequest(
        shape.request_id if count == 1 else f"{shape.request_id}-{index}",
        prompt,
        params,
        salts[0],
        min_hit_tokens=tenant.min_hit_tokens,
        zero_on_evict=tenant.zero_on_evict,
        use_tier=tenant.uses_tier,
        owner=tenant.name,
        previous_cache_salt=salts[1],
        retention=retention or openai_keeps(controls.retention_class, len(prompt)),
        cache_key=controls.cache_key,
        priority=controls.priority,
    )


def _priority(tenant: Tenant, body: object) -> int:
    """The body's ``priority`` (else the tenant's default); 400 above the tenant's cap."""
    try:
        return tenant.priority_of(getattr(body, "priority", None))
    except ValueError as error:
        raise ApiError(400, str(error), "priority") from None


@dataclass(frozen=True, slots=True)
class _Controls:
    """A request's controls: a retention class, its cache key's opaque id, its priority."""

    retention_class: str | None = None  # None: automatic caching only
    cache_key: str | None = None  # Tenants.cache_key_id: never the client's raw key
    priority: int = 0  # lower is scheduled first


@dataclass(slots=True)
class _Done:
    """Accounting when a request ends, once: metrics, one log line and its record in
    ``Server.recent`` (counts and times, never text)."""

    server: Server
    tenant: Tenant
    salt: str
    request_id: str
    endpoint: str
    cache_key: str | None = None  # an opaque id: its first hex digits go in the log line
    priority: int = 0
    called: bool = False

    def __call__(self, parts: list[RequestOutput], status: str = "ok") -> None:
        if self.called:
            return
        self.called = True
        self.server.metrics.requests.labels(self.tenant.name, self.endpoint, status).inc()
        if status == "ok":
            for output in parts:
                self.server.metrics.observe(self.tenant.name, output, self.salt)
        record = request_record(
            self.request_id, self.tenant.name, self.endpoint, self.priority, status, parts
        )
        key = f" cache_key={self.cache_key[:CACHE_KEY_LOG_CHARS]}" if self.cache_key else ""
        log.info(
            "%s%s tenant=%s prompts=%d prompt_tokens=%d cached_tokens=%d completion_tokens=%d "
            "status=%s%s",
            self.request_id,
            key,
            self.tenant.name,
            record["prompts"],
            record["prompt_tokens"],
            record["cached_tokens"],
            record["completion_tokens"],
            status,
            waited_field(p.metrics.queue_seconds for p in parts),
        )
        self.server.recent.add(record)

    def once(self, fan_in: FanIn) -> None:
        """The end of a stream that may never have started: close it and account for it."""
        fan_in.close()
        self(fan_in.finals(), "disconnected")


async def _client_gone(request: Request) -> None:
    """Return once the client has disconnected (ASGI ``http.disconnect``)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _until_finished(
    fan_in: FanIn, request: Request, done: _Done
) -> list[RequestOutput] | None:
    """Every part's final snapshot; None if the client went away first (then all are
    aborted within one engine step, and the request is logged ``disconnected``)."""
    gone = asyncio.ensure_future(_client_gone(request))
    status = "disconnected"
    try:
        while not fan_in.finished:
            step = asyncio.ensure_future(fan_in.next())
            await asyncio.wait({step, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                step.cancel()
                return None
            step.result()
        status = "ok"
        return fan_in.finals()
    except RuntimeError:  # the engine step failed
        status = "engine_error"
        raise
    except asyncio.CancelledError:  # shutdown gave up waiting for it
        status = "cancelled"
        raise
    finally:
        gone.cancel()
        fan_in.close()
        done(fan_in.finals(), status)


async def _sse(fan_in: FanIn, formatter, include_usage: bool, done: _Done):
    """SSE events: role, text deltas, finish, optional usage, then [DONE]."""
    status = "disconnected"
    try:
        for event in formatter.first_chunks():
            yield event
        while not fan_in.finished:
            part, output = await fan_in.next()
            for event in formatter.chunks(output, part):
                yield event
        last = formatter.last_chunks(fan_in.finals(), include_usage)
        status = "ok"
        for event in last:
            yield event
    except RuntimeError as error:  # the engine step failed, or the shutdown deadline came
        status = "engine_error"
        yield failure_event(error)
    finally:
        fan_in.close()
        done(fan_in.finals(), status)


def started_banner(tenants: Tenants, model_name: str, host: str, port: int) -> str:
    """What the server says at start-up (the single-tenant mode is said out loud)."""
    mode = (
        "single local tenant: no API key file, every request shares one cache salt"
        if tenants.local
        else "multi-tenant: API keys required, one cache salt per tenant"
    )
    return (
        f"prefixcache serving {model_name!r} on http://{host}:{port} ({mode}) at "
        f"{time.strftime('%H:%M:%S')}"
    )


class GracefulServer(StoppingServer):
    """uvicorn, with the app told to refuse new requests (503) the moment a signal arrives.

    uvicorn then stops accepting connections and lets running requests finish; shortly
    before ``shutdown_timeout`` the requests still running are ended (a stream gets an error
    event, a whole response a 503) and the lifespan shutdown stops the engine thread, the
    event publisher and the preparation workers (``StoppingServer``: the hard deadline and
    the second signal).
    """

    def __init__(self, config: uvicorn.Config, state: Server, hard_deadline: bool) -> None:
        super().__init__(config, hard_deadline)
        self.state = state

    def on_first_signal(self) -> None:
        log.info(
            "shutting down: no new requests; %d in flight", self.state.async_engine.num_pending
        )
        self.state.draining = True
        self.before_the_deadline(partial(self.state.async_engine.end_all, SHUTTING_DOWN))

    def last_words(self) -> None:
        self.state.pool.close(timeout=0.0)


def graceful_server(
    app: FastAPI, host: str, port: int, shutdown_timeout: float, hard_deadline: bool = False
) -> GracefulServer:
    """A uvicorn server for ``app`` that shuts down within ``shutdown_timeout`` seconds
    (``hard_deadline``: this process exits ``TEARDOWN_SECONDS`` later whatever still runs)."""
    timeout = app.state.server.limits.request_read_timeout
    config = uvicorn_config(
        app, host, port, timeout, log_level="info", timeout_graceful_shutdown=shutdown_timeout
    )
    return GracefulServer(config, app.state.server, hard_deadline)
