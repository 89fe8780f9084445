"""The FastAPI application: OpenAI endpoints over the async engine, per-tenant salts."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from prefixcache.engine.async_engine import AsyncLLMEngine
from prefixcache.engine.engine import LLMEngine
from prefixcache.engine.request import RequestOutput
from prefixcache.engine.sampling import SamplingParams
from prefixcache.server import openai_format
from prefixcache.server.auth import AuthError, Tenant, Tenants
from prefixcache.server.events import KVEventPublisher
from prefixcache.server.limits import DEFAULT_MAX_PENDING
from prefixcache.server.metrics import ServerMetrics
from prefixcache.server.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields

log = logging.getLogger("prefixcache.server")
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
}


class ApiError(Exception):
    """An error the client caused, sent as an OpenAI-style ``error`` object."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def response(self) -> JSONResponse:
        error = {
            "message": self.message,
            "type": ERROR_TYPES.get(self.status, "server_error"),
            "param": self.param,
            "code": None,
        }
        return JSONResponse({"error": error}, status_code=self.status)


@dataclass(slots=True)
class Server:
    """What the handlers share."""

    async_engine: AsyncLLMEngine
    model_name: str
    tenants: Tenants
    metrics: ServerMetrics
    max_pending: int
    identity: dict = field(default_factory=dict)  # see replica_identity

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
) -> FastAPI:
    """The app; its lifespan starts and stops the engine thread (and the event publisher)."""
    server = Server(AsyncLLMEngine(engine), model_name, tenants, ServerMetrics(engine), max_pending)
    server.identity = replica_identity(engine, publisher)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        server.async_engine.start()
        yield
        server.async_engine.shutdown()
        if publisher is not None:
            publisher.close()

    app = FastAPI(title="prefixcache", lifespan=lifespan)
    app.state.server = server
    app.add_exception_handler(ApiError, lambda _, error: error.response())
    app.add_exception_handler(Exception, _internal_error)
    _add_routes(app, server)
    return app


def replica_identity(engine: LLMEngine, publisher: KVEventPublisher | None) -> dict:
    """Block size, namespace digest, tier medium and event endpoints (no tenant data)."""
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
        "tier": None if engine.tier is None else engine.tier.client.medium,
        "kv_events": events,
    }


def _internal_error(request: Request, error: Exception) -> JSONResponse:
    """A bug of ours, not the client's input: log the type and path, never the body."""
    log.error("internal error on %s: %s", request.url.path, type(error).__name__, exc_info=error)
    body = {
        "error": {
            "message": "internal server error",
            "type": "server_error",
            "param": None,
            "code": None,
        }
    }
    return JSONResponse(body, status_code=500)


def _add_routes(app: FastAPI, server: Server) -> None:
    @app.get("/health")
    async def health() -> dict:
        """Liveness, and what a router needs to compute this replica's digests."""
        return {"status": "ok", "model": server.model_name, **server.identity}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        _tenant(server, request)
        return {
            "object": "list",
            "data": [
                {
                    "id": server.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "prefixcache",
                }
            ],
        }

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        tenant = _tenant(server, request)
        body = await _parse(request, ChatCompletionRequest, server)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            prompt = server.engine.tokenizer.encode_chat(messages)
        except ValueError as error:
            raise ApiError(400, f"messages: {error}", "messages") from None
        return await _serve(server, request, tenant, body, prompt, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        tenant = _tenant(server, request)
        body = await _parse(request, CompletionRequest, server)
        prompt = body.prompt
        if isinstance(prompt, str):
            prompt = server.engine.tokenizer.encode(prompt, add_special_tokens=True)
        return await _serve(server, request, tenant, body, prompt, chat=False)

    @app.post("/admin/reset_prefix_cache")
    async def reset(request: Request) -> dict:
        tenant = _tenant(server, request)
        if not tenant.admin:
            raise ApiError(403, f"tenant {tenant.name!r} is not an admin")
        return await server.async_engine.run_in_engine(_reset_report)


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


def _tenant(server: Server, request: Request) -> Tenant:
    try:
        return server.tenants.authenticate(request.headers.get("authorization"))
    except AuthError as error:
        raise ApiError(401, str(error)) from None


async def _parse(request: Request, schema: type[BaseModel], server: Server) -> SamplingFields:
    """The body as ``schema``: 400 for bad JSON or a bad field, 404 for another model."""
    try:
        data = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ApiError(400, f"request body is not valid JSON: {error}") from None
    try:
        body = schema.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "body"
        raise ApiError(400, f"{field}: {first['msg']}", field) from None
    unsupported = body.unsupported_field()
    if unsupported:
        raise ApiError(400, f"{unsupported} is not supported by this server", unsupported)
    if body.model != server.model_name:
        raise ApiError(
            404,
            f"model {body.model!r} does not exist; this server serves {server.model_name!r}",
            "model",
        )
    return body


def _sampling(body: SamplingFields, prompt_len: int, context: int) -> SamplingParams:
    """Sampling parameters, with the token limit checked against the context."""
    room = context - prompt_len
    limit = body.token_limit()
    if room < 1 or (limit is not None and limit > room):
        raise ApiError(
            400,
            f"this model's context is {context} tokens; the prompt has "
            f"{prompt_len} and {limit or 1} more were requested",
            "max_tokens",
        )
    return SamplingParams(
        n=body.n,
        max_tokens=limit or room,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        stop=body.stop,
        ignore_eos=body.ignore_eos,
    )


async def _serve(
    server: Server,
    request: Request,
    tenant: Tenant,
    body: SamplingFields,
    prompt: list[int],
    chat: bool,
) -> Response:
    """Run one request through the engine; stream it or answer when done."""
    params = _sampling(body, len(prompt), server.engine.max_model_len)
    if server.async_engine.num_pending >= server.max_pending:
        raise ApiError(
            429,
            f"server overloaded: {server.async_engine.num_pending} requests "
            f"pending (limit {server.max_pending}); retry later",
        )
    salt = server.tenants.cache_salt(tenant, body.cache_salt)
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    stream = server.async_engine.generate(
        request_id,
        prompt,
        params,
        cache_salt=salt,
        min_hit_tokens=tenant.min_hit_tokens,
        zero_on_evict=tenant.zero_on_evict,
        use_tier=tenant.uses_tier,
    )
    try:
        first = await anext(stream)
    except ValueError as error:  # the engine refused it: too long for context or pool
        raise ApiError(400, str(error), "messages" if chat else "prompt") from None
    done = _Done(server, tenant, salt, request_id, "chat" if chat else "completions")
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        formatter = openai_format.StreamFormatter(request_id, body.model, chat, body.n)
        events = _sse(stream, first, formatter, include_usage, done)
        return StreamingResponse(events, media_type="text/event-stream")
    final = await _until_finished(stream, first, request)
    done(final)
    build = openai_format.chat_response if chat else openai_format.completion_response
    return JSONResponse(build(request_id, body.model, final))


@dataclass(slots=True)
class _Done:
    """Accounting when a request ends: metrics and one log line (counts, never text)."""

    server: Server
    tenant: Tenant
    salt: str
    request_id: str
    endpoint: str

    def __call__(self, output: RequestOutput, status: str = "ok") -> None:
        self.server.metrics.requests.labels(self.tenant.name, self.endpoint, status).inc()
        if status == "ok":
            self.server.metrics.observe(self.tenant.name, output, self.salt)
        log.info(
            "%s tenant=%s prompt_tokens=%d cached_tokens=%d completion_tokens=%d status=%s",
            self.request_id,
            self.tenant.name,
            len(output.prompt_token_ids),
            output.num_cached_tokens,
            sum(len(o.token_ids) for o in output.outputs),
            status,
        )


async def _until_finished(stream, first: RequestOutput, request: Request) -> RequestOutput:
    """The final snapshot; aborts the request if the client goes away while waiting."""
    output = first
    try:
        while not output.finished:
            step = asyncio.ensure_future(anext(stream))
            while not step.done():
                await asyncio.wait({step}, timeout=0.5)
                if not step.done() and await request.is_disconnected():
                    step.cancel()
                    raise ApiError(499, "client closed the request")
            output = step.result()
        return output
    finally:
        await stream.aclose()


async def _sse(stream, first: RequestOutput, formatter, include_usage: bool, done: _Done):
    """SSE events: role, text deltas, finish, optional usage, then [DONE]."""
    output = first
    status = "disconnected"
    try:
        for event in formatter.first_chunks():
            yield event
        while True:
            for event in formatter.chunks(output):
                yield event
            if output.finished:
                break
            output = await anext(stream)
        if include_usage:
            yield formatter.usage_chunk(output)
        status = "ok"
        yield openai_format.DONE
    except RuntimeError as error:  # the engine step failed: tell the client, end cleanly
        status = "engine_error"
        yield f"data: {json.dumps({'error': {'message': str(error), 'type': 'server_error'}})}\n\n"
    finally:
        await stream.aclose()
        done(output, status)


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
