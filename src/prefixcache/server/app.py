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
from types import FrameType

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from prefixcache.engine.async_engine import AddRequest, AsyncLLMEngine, RequestStream
from prefixcache.engine.engine import LLMEngine
from prefixcache.engine.request import RequestOutput
from prefixcache.engine.sampling import SamplingParams, fold_seed
from prefixcache.server import openai_format
from prefixcache.server.auth import AuthError, Tenant, Tenants
from prefixcache.server.events import KVEventPublisher
from prefixcache.server.fan_in import FanIn
from prefixcache.server.limits import DEFAULT_MAX_PENDING
from prefixcache.server.metrics import ServerMetrics
from prefixcache.server.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields

log = logging.getLogger("prefixcache.server")
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
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
) -> FastAPI:
    """The app; its lifespan starts and stops the engine thread (and the event publisher)."""
    metrics = ServerMetrics(engine, model_name)
    server = Server(AsyncLLMEngine(engine), model_name, tenants, metrics, max_pending)
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
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, internal_error)
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


async def _api_error(_: Request, error: ApiError) -> JSONResponse:
    """An async handler: no worker thread, so it also answers during shutdown."""
    return error.response()


async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
    """Routing errors (unknown path 404, wrong method 405) as OpenAI error objects."""
    if error.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    elif error.status_code == 404:
        message = f"no such endpoint: {request.method} {request.url.path}"
    else:
        message = str(error.detail)
    response = ApiError(error.status_code, message).response()
    response.headers.update(error.headers or {})
    return response


def internal_error(request: Request, error: Exception) -> JSONResponse:
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
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> dict:
        """Liveness, and what a router needs to compute this replica's digests."""
        return {"status": "ok", "model": server.model_name, **server.identity}

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models(request: Request) -> dict:
        _tenant(server, request)
        return {"object": "list", "data": [_model_card(server)]}

    @app.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])
    async def model(model_id: str, request: Request) -> dict:
        _tenant(server, request)
        if model_id != server.model_name:
            raise ApiError(404, _no_such_model(model_id, server), "model")
        return _model_card(server)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        tenant = _tenant(server, request)
        body = await _parse(request, ChatCompletionRequest, server)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            prompt = server.engine.tokenizer.encode_chat(messages)
        except ValueError as error:
            raise ApiError(400, f"messages: {error}", "messages") from None
        shape = _shape(server, body, chat=True)
        return await _serve(server, request, tenant, body, [prompt], shape)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        tenant = _tenant(server, request)
        body = await _parse(request, CompletionRequest, server)
        tokenizer = server.engine.tokenizer
        prompts = [
            tokenizer.encode(p, add_special_tokens=True) if isinstance(p, str) else p
            for p in body.prompt
        ]
        shape = _shape(server, body, chat=False)
        if body.echo:
            shape.echo = [
                p if isinstance(p, str) else tokenizer.decode(p, skip_special_tokens=False)
                for p in body.prompt
            ]
        return await _serve(server, request, tenant, body, prompts, shape)

    @app.post("/admin/reset_prefix_cache")
    async def reset(request: Request) -> dict:
        tenant = _tenant(server, request)
        if not tenant.admin:
            raise ApiError(403, f"tenant {tenant.name!r} is not an admin")
        return await server.async_engine.run_in_engine(_reset_report)


def _model_card(server: Server) -> dict:
    return {"id": server.model_name, "object": "model", "created": 0, "owned_by": "prefixcache"}


def _no_such_model(name: str, server: Server) -> str:
    return f"model {name!r} does not exist; this server serves {server.model_name!r}"


def _shape(server: Server, body: SamplingFields, chat: bool) -> openai_format.Shape:
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    return openai_format.Shape(
        request_id,
        body.model,
        chat,
        body.n,
        server.engine.tokenizer,
        logprobs=body.logprob_count() is not None,
    )


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
    if server.draining:
        raise ApiError(503, "the server is shutting down; retry on another replica")
    try:
        data = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ApiError(400, f"request body is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    try:
        body = schema.model_validate(data)
    except ValidationError as error:
        raise _field_error(error) from None
    unsupported = body.unsupported_field()
    if unsupported:
        raise ApiError(400, unsupported[1], unsupported[0])
    if body.model != server.model_name:
        raise ApiError(404, _no_such_model(body.model, server), "model")
    return body


def _field_error(error: ValidationError) -> ApiError:
    """400 naming the first bad field (its path) and what it accepts."""
    first = error.errors()[0]
    field = ".".join(str(part) for part in first["loc"]) or "body"
    message = first["msg"].removeprefix("Value error, ")
    return ApiError(400, f"{field}: {message}", field)


def _check_room(limit: int | None, prompt_lens: list[int], context: int) -> None:
    """400 unless every prompt leaves room for the requested tokens (at least 1)."""
    for prompt_len in prompt_lens:
        room = context - prompt_len
        if room < 1 or (limit is not None and limit > room):
            raise ApiError(
                400,
                f"this model's context is {context} tokens; the prompt has "
                f"{prompt_len} and {limit or 1} more were requested",
                "max_tokens",
            )


def _sampling(body: SamplingFields, prompt_lens: list[int], context: int) -> SamplingParams:
    """Sampling parameters, with the token limit checked against the context."""
    limit = body.token_limit()
    _check_room(limit, prompt_lens, context)
    prompt_logprobs = getattr(body, "prompt_logprob_count", lambda: None)()
    try:
        return SamplingParams(
            n=body.n,
            max_tokens=context - max(prompt_lens) if limit is None else limit,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k_limit(),
            min_p=body.min_p,
            seed=None if body.seed is None else fold_seed(body.seed),
            stop=body.stop,
            stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            logit_bias=body.bias(),
            logprobs=body.logprob_count(),
            prompt_logprobs=prompt_logprobs,
        )
    except ValueError as error:  # a combination out of range (min_tokens > max_tokens, ...)
        raise ApiError(400, str(error), str(error).split(" ", 1)[0]) from None


async def _serve(
    server: Server,
    request: Request,
    tenant: Tenant,
    body: SamplingFields,
    prompts: list[list[int]],
    shape: openai_format.Shape,
) -> Response:
    """Run one request (one engine request per prompt) through the engine; stream or answer."""
    params = _sampling(body, [len(p) for p in prompts], server.engine.max_model_len)
    pending = server.async_engine.num_pending
    if pending + len(prompts) > server.max_pending:
        raise ApiError(
            429,
            f"server overloaded: {pending} requests pending (limit {server.max_pending}); "
            "retry later",
        )
    salt = server.tenants.cache_salt(tenant, body.cache_salt)
    fan_in = await _open(server, tenant, shape, prompts, params, salt)
    done = _Done(server, tenant, salt, shape.request_id, "chat" if shape.chat else "completions")
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        formatter = openai_format.StreamFormatter(shape, len(prompts))
        events = _sse(fan_in, formatter, include_usage, done)
        return StreamingResponse(
            events, media_type="text/event-stream", headers=openai_format.STREAM_HEADERS
        )
    try:
        finals = await _until_finished(fan_in, request, done)
    except asyncio.CancelledError:
        if not server.draining:
            raise
        asyncio.current_task().uncancel()  # handled: answer 503 instead of a dropped socket
        raise ApiError(503, "the server shut down before this request finished") from None
    if finals is None:
        return Response(status_code=499)  # nobody is listening
    return JSONResponse(openai_format.response(shape, finals))


async def _open(
    server: Server,
    tenant: Tenant,
    shape: openai_format.Shape,
    prompts: list[list[int]],
    params: SamplingParams,
    salt: str,
) -> FanIn:
    """Put every prompt in the engine together (so they share their prefix); 400 if refused."""
    adds = [
        _add_request(shape, i, len(prompts), p, params, salt, tenant) for i, p in enumerate(prompts)
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
            param = "messages" if shape.chat else "prompt"
            raise ApiError(400, str(failure), param) from None
        raise failure
    return FanIn(streams)


def _add_request(
    shape: openai_format.Shape,
    index: int,
    count: int,
    prompt: list[int],
    params: SamplingParams,
    salt: str,
    tenant: Tenant,
) -> AddRequest:
    """Prompt ``index`` of ``count`` as an engine request (ids ``<id>-<index>`` for a batch)."""
    return AddRequest(
        shape.request_id if count == 1 else f"{shape.request_id}-{index}",
        prompt,
        params,
        salt,
        min_hit_tokens=tenant.min_hit_tokens,
        zero_on_evict=tenant.zero_on_evict,
        use_tier=tenant.uses_tier,
    )


@dataclass(slots=True)
class _Done:
    """Accounting when a request ends: metrics and one log line (counts, never text)."""

    server: Server
    tenant: Tenant
    salt: str
    request_id: str
    endpoint: str

    def __call__(self, parts: list[RequestOutput], status: str = "ok") -> None:
        self.server.metrics.requests.labels(self.tenant.name, self.endpoint, status).inc()
        if status == "ok":
            for output in parts:
                self.server.metrics.observe(self.tenant.name, output, self.salt)
        log.info(
            "%s tenant=%s prompts=%d prompt_tokens=%d cached_tokens=%d completion_tokens=%d "
            "status=%s",
            self.request_id,
            self.tenant.name,
            len(parts),
            sum(len(p.prompt_token_ids) for p in parts),
            sum(p.num_cached_tokens for p in parts),
            sum(len(o.token_ids) for p in parts for o in p.outputs),
            status,
        )


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
        if include_usage:
            yield formatter.usage_chunk(fan_in.finals())
        status = "ok"
        yield openai_format.DONE
    except RuntimeError as error:  # the engine step failed: tell the client, end cleanly
        status = "engine_error"
        yield f"data: {json.dumps({'error': {'message': str(error), 'type': 'server_error'}})}\n\n"
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


class GracefulServer(uvicorn.Server):
    """uvicorn, with the app told to refuse new requests (503) the moment a signal arrives.

    uvicorn then stops accepting connections, lets running requests finish for
    ``timeout_graceful_shutdown`` seconds, cancels the rest (their requests are aborted)
    and runs the lifespan shutdown (the engine thread stops, leftovers are freed).
    """

    def __init__(self, config: uvicorn.Config, state: Server) -> None:
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.state.draining:
            log.info(
                "shutting down: no new requests; %d in flight", self.state.async_engine.num_pending
            )
        self.state.draining = True
        super().handle_exit(sig, frame)


def graceful_server(app: FastAPI, host: str, port: int, shutdown_timeout: float) -> GracefulServer:
    """A uvicorn server for ``app`` that shuts down within ``shutdown_timeout`` seconds."""
    config = uvicorn.Config(
        app, host=host, port=port, log_level="info", timeout_graceful_shutdown=shutdown_timeout
    )
    return GracefulServer(config, app.state.server)
