"""The routes that run no engine request: token counts and ids (the prompt a completion
would prefill, computed on a prepare thread), and the caller's stored responses.

They wear the same front as the completion routes (auth, the tenant's share, 429), and
each answers in its API's error shape (Anthropic's for ``count_tokens``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request

from prefixcache.protocol import openapi
from prefixcache.protocol.anthropic_schemas import CountTokensRequest
from prefixcache.protocol.front import get_and_head
from prefixcache.protocol.guard import tenant_of
from prefixcache.protocol.openapi import json_body, responses
from prefixcache.protocol.tokenize_schemas import DetokenizeRequest, TokenizeRequest
from prefixcache.server import stored_responses
from prefixcache.server.messages import count_message_tokens
from prefixcache.server.prepare import PrepareContext
from prefixcache.server.response_store import TenantResponses
from prefixcache.server.tokenize import detokenize, tokenize

if TYPE_CHECKING:
    from prefixcache.server.app import Server

COUNT_TOKENS, TOKENIZE, DETOKENIZE = "/v1/messages/count_tokens", "/tokenize", "/detokenize"
STORED, INPUT_ITEMS = "/v1/responses/{response_id}", "/v1/responses/{response_id}/input_items"
LOOKUP_PATHS = (COUNT_TOKENS, TOKENIZE, DETOKENIZE, STORED, INPUT_ITEMS)  # metered: auth, share


def add_token_routes(app: FastAPI, server: Server) -> None:
    """Token counts and ids: the prompt a completion would prefill, without running it."""
    statuses = (401, 404, 429, 503)

    @app.post(
        COUNT_TOKENS,
        openapi_extra=json_body(CountTokensRequest),
        responses=responses(openapi.TokenCount, *statuses, anthropic=True),
    )
    async def count_tokens(request: Request) -> dict:
        """Anthropic's token count: the prompt tokens ``/v1/messages`` would prefill."""
        return await _prepared_only(server, request, count_message_tokens)

    @app.post(
        TOKENIZE,
        openapi_extra=json_body(TokenizeRequest),
        responses=responses(openapi.Tokenized, *statuses),
    )
    async def tokenize_route(request: Request) -> dict:
        """vLLM's ``/tokenize``: a prompt's or chat's ids, as a completion of it prefills."""
        return await _prepared_only(server, request, tokenize)

    @app.post(
        DETOKENIZE,
        openapi_extra=json_body(DetokenizeRequest),
        responses=responses(openapi.Detokenized, *statuses),
    )
    async def detokenize_route(request: Request) -> dict:
        """vLLM's ``/detokenize``: token ids back to text."""
        return await _prepared_only(server, request, detokenize)


async def _prepared_only(
    server: Server, request: Request, work: Callable[[bytes, PrepareContext], dict]
) -> dict:
    """``work(body)`` on a prepare thread: parsing and tokenizing, no engine request (so it
    is answered while the server drains, too)."""
    return await server.pool.run(work, await request.body(), server.prepare)


def add_stored_routes(app: FastAPI, server: Server) -> None:
    """The caller's stored responses: read back, their input items listed, deleted."""

    def view(request: Request) -> TenantResponses:
        return server.responses.view(tenant_of(request.scope).name)

    @get_and_head(app, STORED, responses=responses(openapi.StoredResponse, 401, 404, 429))
    async def retrieve_response(request: Request, response_id: str) -> dict:
        """A stored response, as it was answered (404 for another tenant's id)."""
        return stored_responses.retrieve(view(request), response_id, request.query_params)

    @app.delete(STORED, responses=responses(openapi.DeletedResponse, 401, 404, 429))
    async def delete_response(request: Request, response_id: str) -> dict:
        """Forget a stored response: it can no longer be read or continued."""
        return stored_responses.delete(view(request), response_id)

    @get_and_head(
        app,
        INPUT_ITEMS,
        openapi_extra=openapi.INPUT_ITEMS_QUERY,
        responses=responses(openapi.InputItemList, 401, 404, 429),
    )
    async def input_items(request: Request, response_id: str) -> dict:
        """A page of a stored response's own input items."""
        query = request.query_params
        return stored_responses.input_items(view(request), response_id, query)
