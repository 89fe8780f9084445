"""The router's routes: a replica's endpoints, each forwarded to the replica chosen for it.

The guard (``protocol/guard.py``) has checked the key and read the body before a handler
runs. A completion's, message's or response's body is parsed and tokenized on a worker
thread (at most ``PREPARE_THREADS`` at once), and its digests hashed there too, so a
large prompt never stalls the event loop (``/health`` answers meanwhile).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import quote, urlencode

import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from pydantic import BaseModel

from prefixcache.protocol import openapi
from prefixcache.protocol.anthropic_schemas import CountTokensRequest, MessagesRequest
from prefixcache.protocol.auth import Tenant
from prefixcache.protocol.front import get_and_head
from prefixcache.protocol.guard import RoutePolicy, tenant_of
from prefixcache.protocol.openapi import json_body, responses
from prefixcache.protocol.response_ids import instance_of
from prefixcache.protocol.responses_schemas import ResponsesRequest
from prefixcache.protocol.schemas import ChatCompletionRequest, CompletionRequest
from prefixcache.protocol.tokenize_schemas import DetokenizeRequest, TokenizeRequest
from prefixcache.router import prompts
from prefixcache.router.affinity import key_digest
from prefixcache.router.digests import prompt_digests
from prefixcache.router.forward import RouteLog
from prefixcache.router.prompts import RoutingView, routing_view
from prefixcache.router.replicas import ClusterNamespace

if TYPE_CHECKING:
    from prefixcache.router.app import RouterState

T = TypeVar("T")
CHAT, COMPLETIONS, MODELS = "/v1/chat/completions", "/v1/completions", "/v1/models"
MESSAGES, RESPONSES = "/v1/messages", "/v1/responses"
COUNT_TOKENS, TOKENIZE, DETOKENIZE = "/v1/messages/count_tokens", "/tokenize", "/detokenize"
STORED, INPUT_ITEMS = RESPONSES + "/{response_id}", RESPONSES + "/{response_id}/input_items"
LOOKUPS = (COUNT_TOKENS, TOKENIZE, DETOKENIZE, STORED, INPUT_ITEMS)  # no engine work
STORED_QUERY = ("limit", "order", "after", "include", "stream")  # passed on to the replica
PATHS = {
    prompts.CHAT: CHAT,
    prompts.COMPLETIONS: COMPLETIONS,
    prompts.MESSAGES: MESSAGES,
    prompts.RESPONSES: RESPONSES,
}  # the routing view's endpoint name -> the replica's path
SCHEMA_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
ROUTES = RoutePolicy(
    public=frozenset({"/health"}),
    admin=frozenset({"/metrics", "/admin/replicas", *SCHEMA_PATHS}),
    metered=frozenset({CHAT, COMPLETIONS, MESSAGES, RESPONSES, *LOOKUPS}),
)


class RouterHealth(BaseModel):
    """The router's ``/health``: up if any replica is, and each replica's state."""

    status: str
    policy: str
    model: str | None
    block_size: int | None
    namespace_digest: str | None
    replicas: list[dict[str, Any]]
    detail: str | None = None


def add_routes(app: FastAPI, state: RouterState) -> None:
    """``/health``, ``/metrics``, the models, the completion, messages and responses endpoints."""
    health_statuses = responses(RouterHealth)
    health_statuses[503] = {"model": RouterHealth, "description": "No replica is healthy"}

    @get_and_head(app, "/health", responses=health_statuses)
    async def health() -> JSONResponse:
        return state.health()

    @get_and_head(app, "/admin/replicas", responses=responses(None, 401, 403))
    async def replicas() -> dict:
        """Every replica's URL, state and last errors (admin key): the operator's view."""
        return {"replicas": state.replica_states(with_addresses=True)}

    @get_and_head(app, "/metrics", responses=openapi.plain_text(responses(None, 401, 403)))
    async def metrics() -> Response:
        """Prometheus metrics; with an API key file, for admin keys only."""
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_PLAIN_0_0_4)

    @get_and_head(app, MODELS, responses=responses(openapi.ModelList, 401, 503))
    async def models(request: Request) -> Response:
        return await _forward_plain(state, request, MODELS)

    @get_and_head(
        app, MODELS + "/{model_id:path}", responses=responses(openapi.ModelCard, 401, 404, 503)
    )
    async def model(request: Request, model_id: str) -> Response:
        return await _forward_plain(state, request, f"{MODELS}/{path_segment(model_id)}")

    _add_completions(app, state)
    _add_lookups(app, state)


def _add_completions(app: FastAPI, state: RouterState) -> None:
    statuses = (401, 404, 429, 503)

    @app.post(
        CHAT,
        openapi_extra=json_body(ChatCompletionRequest),
        responses=responses(openapi.ChatCompletion, *statuses, stream=True),
    )
    async def chat(request: Request) -> Response:
        return await _complete(state, request, prompts.CHAT)

    @app.post(
        COMPLETIONS,
        openapi_extra=json_body(CompletionRequest),
        responses=responses(openapi.Completion, *statuses, stream=True),
    )
    async def completions(request: Request) -> Response:
        return await _complete(state, request, prompts.COMPLETIONS)

    @app.post(
        MESSAGES,
        openapi_extra=json_body(MessagesRequest),
        responses=responses(openapi.Message, *statuses, stream=True, anthropic=True),
    )
    async def messages(request: Request) -> Response:
        """Anthropic's Messages API, to the replica holding most of the conversation."""
        return await _complete(state, request, prompts.MESSAGES)

    @app.post(
        RESPONSES,
        openapi_extra=json_body(ResponsesRequest),
        responses=responses(None, *statuses, stream=True),
    )
    async def create_response(request: Request) -> Response:
        """OpenAI's Responses API; a ``previous_response_id`` goes to the replica storing it."""
        return await _complete(state, request, prompts.RESPONSES)


def _add_lookups(app: FastAPI, state: RouterState) -> None:
    """Token counts and ids to any replica (they run no engine request); a stored response
    to the replica whose instance its id names, as a ``previous_response_id`` is."""
    statuses = (401, 404, 429, 503)
    for path, body, answer, anthropic in (
        (COUNT_TOKENS, CountTokensRequest, openapi.TokenCount, True),
        (TOKENIZE, TokenizeRequest, openapi.Tokenized, False),
        (DETOKENIZE, DetokenizeRequest, openapi.Detokenized, False),
    ):
        app.add_api_route(
            path, _body_forwarder(state, path), methods=["POST"],
            openapi_extra=json_body(body),
            responses=responses(answer, *statuses, anthropic=anthropic),
            name=path.rsplit("/", 1)[-1],
        )  # fmt: skip

    @get_and_head(app, STORED, responses=responses(openapi.StoredResponse, *statuses))
    async def retrieve_response(request: Request, response_id: str) -> Response:
        """A stored response, from the replica that stored it."""
        return await _forward_stored(state, request, response_id, "")

    @app.delete(STORED, responses=responses(openapi.DeletedResponse, *statuses))
    async def delete_response(request: Request, response_id: str) -> Response:
        """Delete a stored response, on the replica that stored it."""
        return await _forward_stored(state, request, response_id, "")

    @get_and_head(
        app,
        INPUT_ITEMS,
        openapi_extra=openapi.INPUT_ITEMS_QUERY,
        responses=responses(openapi.InputItemList, *statuses),
    )
    async def input_items(request: Request, response_id: str) -> Response:
        """A page of a stored response's input items, from the replica that stored it."""
        return await _forward_stored(state, request, response_id, "/input_items")


def _body_forwarder(state: RouterState, path: str) -> Callable:
    """The handler of ``path``: a body that runs no engine request, to any healthy replica
    (the replica checks the body and answers in its route's shape)."""

    async def forward_body(request: Request) -> Response:
        state.namespace()
        raw = await request.body()
        route = RouteLog(path.rsplit("/", 1)[-1])  # count_tokens, tokenize, detokenize
        return await state.forwarder.forward(request, path, raw, [], False, route)

    return forward_body


async def _forward_stored(
    state: RouterState, request: Request, response_id: str, tail: str
) -> Response:
    """To the replica whose instance ``response_id`` names (down or unknown: any replica,
    which answers 404); the query's known parameters re-encoded, nothing else passed."""
    state.namespace()
    query = urlencode([(k, v) for k, v in request.query_params.multi_items() if k in STORED_QUERY])
    path = f"{RESPONSES}/{path_segment(response_id)}{tail}" + (f"?{query}" if query else "")
    pinned = state.fleet.by_instance(instance_of(response_id))
    route = RouteLog(f"{request.method.lower()}_response{tail.replace('/', '_')}")
    return await state.forwarder.forward(
        request, path, b"", [], False, route, pinned=pinned.url if pinned else None
    )


def path_segment(text: str) -> str:
    """``text`` as one path segment: every ``/`` and ``.`` escaped, so no dot segment or
    other path reaches a replica (it decodes the segment back to ``text``)."""
    return quote(text, safe="").replace(".", "%2E")


async def _forward_plain(state: RouterState, request: Request, path: str) -> Response:
    """A bodiless request, to any replica (503 while none is healthy)."""
    state.namespace()
    return await state.forwarder.forward(request, path, b"", [], False, RouteLog("models"))


async def _off_loop(state: RouterState, function: Callable[..., T], *args: object) -> T:
    """``function(*args)`` on one of the router's worker threads."""
    return await anyio.to_thread.run_sync(function, *args, limiter=state.views)


async def _complete(state: RouterState, request: Request, endpoint: str) -> Response:
    """Parse and tokenize off the loop, hash the prompt, forward to the chosen replica."""
    tenant = tenant_of(request.scope)
    raw = await request.body()
    tokenizer = state.config.tokenizer if state.config.policy.uses_digests else None
    view = await _off_loop(state, routing_view, raw, endpoint, tokenizer)
    namespace = state.namespace()
    digests = []
    if view.token_ids:
        digests = await _off_loop(state, _digests, state, namespace, tenant, view)
    tokens = None if view.token_ids is None else len(view.token_ids)
    route = RouteLog(endpoint, tokens, len(digests))
    key = None if view.cache_key is None else key_digest(tenant.name, view.cache_key)
    pinned = state.fleet.by_instance(view.instance)  # down or unknown: any replica (it 404s)
    return await state.forwarder.forward(
        request, PATHS[endpoint], raw, digests, view.stream, route, key,
        pinned.url if pinned else None,
    )  # fmt: skip


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
