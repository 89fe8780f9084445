"""The OpenAPI contract: request bodies, response bodies and every status a route returns.

The handlers read their bodies themselves (bounded, off the event loop), so FastAPI cannot
infer the request models; they are declared here instead, and the response models below
describe what ``openai_format`` writes. Nothing here validates a request.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from prefixcache.protocol.anthropic_schemas import CountTokensRequest, MessagesRequest
from prefixcache.protocol.responses_schemas import ResponsesRequest
from prefixcache.protocol.schemas import ChatCompletionRequest, CompletionRequest, NullMeansDefault
from prefixcache.protocol.tokenize_schemas import DetokenizeRequest, TokenizeRequest

REQUEST_BODIES = [  # every route's request body, declared in /openapi.json (server and router)
    ChatCompletionRequest, CompletionRequest, MessagesRequest, ResponsesRequest,
    CountTokensRequest, TokenizeRequest, DetokenizeRequest,
]  # fmt: skip


class ErrorObject(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorObject


class TokenDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: TokenDetails


class AssistantMessage(BaseModel):
    role: str
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: dict[str, Any] | None


class ChatCompletion(BaseModel):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: dict[str, Any] | None


class Completion(BaseModel):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AnthropicErrorObject(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    type: str
    error: AnthropicErrorObject


class TextBlock(BaseModel):
    type: str
    text: str


class CacheCreation(BaseModel):
    ephemeral_5m_input_tokens: int
    ephemeral_1h_input_tokens: int


class MessageUsage(BaseModel):
    input_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int
    cache_creation: CacheCreation
    output_tokens: int


class Message(BaseModel):
    """A Messages API response (``server/anthropic_format.py``)."""

    id: str
    type: str
    role: str
    model: str
    content: list[TextBlock]
    stop_reason: str | None
    stop_sequence: str | None
    usage: MessageUsage


class ModelCard(BaseModel):
    id: str
    object: str
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: str
    data: list[ModelCard]


class Health(BaseModel):
    status: str
    model: str
    block_size: int
    namespace_digest: str
    kv_cache_dtype: str | None = None  # what its KV pool stores (in the namespace if not fp32)
    decode_activations: str | None = None  # its decode kernels' (in the namespace if not int16)
    tier: str | None
    kv_events: dict[str, Any] | None
    instance: str | None = None  # the replica's instance id, the prefix of its response ids


class TokenCount(BaseModel):
    """``POST /v1/messages/count_tokens``: the prompt tokens ``/v1/messages`` would prefill."""

    input_tokens: int


class Tokenized(BaseModel):
    """``POST /tokenize`` (vLLM's shape)."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str | None] | None


class Detokenized(BaseModel):
    """``POST /detokenize`` (vLLM's shape)."""

    prompt: str


class StoredResponse(BaseModel):
    """A stored Responses API response, as it was answered (``server/responses_format.py``)."""

    id: str
    object: str
    status: str
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None


class DeletedResponse(BaseModel):
    id: str
    object: str
    deleted: bool


class InputItemList(BaseModel):
    """A page of a stored response's input items."""

    object: str
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


INPUT_ITEMS_QUERY = {  # GET /v1/responses/{id}/input_items: read by the handler itself
    "parameters": [
        {"name": "limit", "in": "query", "required": False,
         "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
        {"name": "order", "in": "query", "required": False,
         "schema": {"type": "string", "enum": ["asc", "desc"]}},
        {"name": "after", "in": "query", "required": False, "schema": {"type": "string"}},
    ]
}  # fmt: skip


class ResetReport(BaseModel):
    reset: bool
    detail: str


class CachedPrefix(BaseModel):
    """Where a cached chain forks or ends: its block's digest (hex, cut), depth and use."""

    digest: str
    blocks: int
    tokens: int
    branches: int  # cached continuations after it (0: the chain ends here)
    holders: int  # running sequences holding it


class PrefixList(BaseModel):
    """``GET /admin/prefixes``: forks and ends of the cached chains, shared first, deepest
    first (never tokens)."""

    block_size: int
    prefixes: list[CachedPrefix]


class ServedRequest(BaseModel):
    """``GET /admin/requests/{request_id}``: a recently finished request's counts, times and
    waits by reason (never text or token ids)."""

    request_id: str
    tenant: str
    endpoint: str
    status: str  # ok, disconnected, engine_error, cancelled
    priority: int
    prompts: int
    prompt_tokens: int
    cached_tokens: int
    pool_tokens: int  # of cached_tokens, from the pool
    tier_tokens: int  # of cached_tokens, loaded from the KV tier
    completion_tokens: int
    ttft_seconds: float | None
    total_seconds: float | None
    queue_seconds: dict[str, float]  # step_time, priority, seats, memory, tier_load, fairness


PREFIXES_QUERY = {  # GET /admin/prefixes: read by the handler itself
    "parameters": [
        {"name": "limit", "in": "query", "required": False,
         "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
    ]
}  # fmt: skip


DESCRIPTIONS = {
    400: "Malformed JSON or HTTP, or a field out of range (the message names it and its limit)",
    401: "Missing or unknown API key",
    403: "The key's tenant may not use this route (not an admin)",
    404: "No such model, no stored response of that id for this tenant, or no recently "
    "finished request of that id",
    408: "The request head or body did not arrive within --request-read-timeout",
    413: "The body is larger than --max-body-bytes",
    429: "Too many requests in flight (server or tenant); see Retry-After",
    431: "Too many header fields, or too many header bytes",
    503: "The server is shutting down, or (router) no replica could serve the request",
}
EVERY_ROUTE = (400, 408, 413, 431)
SSE_EVENT = {  # OpenAPI 3.1: the schema of one event of the stream
    "type": "object",
    "properties": {
        "data": {"type": "string", "description": "a JSON chunk; the last event is [DONE]"}
    },
    "required": ["data"],
}


ANTHROPIC_SSE_EVENT = {
    "type": "object",
    "properties": {
        "event": {"type": "string", "description": "message_start, content_block_delta, ..."},
        "data": {"type": "string", "description": "the event as JSON, its type included"},
    },
    "required": ["event", "data"],
}


def responses(
    ok: type[BaseModel] | None, *statuses: int, stream: bool = False, anthropic: bool = False
) -> dict:
    """A route's ``responses``: its 200 body and each error status it can return (errors in
    Anthropic's shape on an ``anthropic`` route)."""
    success: dict[str, Any] = {"description": "OK"}
    if ok is not None:
        success["model"] = ok
    if stream:
        event = ANTHROPIC_SSE_EVENT if anthropic else SSE_EVENT
        success["content"] = {"text/event-stream": {"schema": event}}
    error = AnthropicErrorResponse if anthropic else ErrorResponse
    declared: dict[int | str, dict[str, Any]] = {200: success}
    for status in sorted({*EVERY_ROUTE, *statuses}):
        declared[status] = {"model": error, "description": DESCRIPTIONS[status]}
    return declared


def plain_text(declared: dict) -> dict:
    """``declared`` (from ``responses``) with its 200 body as plain text (``/metrics``)."""
    declared[200]["content"] = {"text/plain": {"schema": {"type": "string"}}}
    return declared


def json_body(model: type[BaseModel]) -> dict:
    """``openapi_extra`` declaring ``model`` as the route's JSON request body."""
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def install(
    app: FastAPI, bodies: list[type[BaseModel]], model_name: Callable[[], str | None]
) -> None:
    """Generate ``/openapi.json`` with the request models added to its components; their
    ``model`` is the one name served (any other is a 404). A router learns that name from
    its replicas: until it knows it, ``model_name()`` is None and the schema is not kept."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            name = model_name()
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in bodies:
                components.update(_component_schemas(model))
                if name is not None:
                    served = {"type": "string", "enum": [name], "title": "Model"}
                    components[model.__name__]["properties"]["model"] = served
            _drop_validation_errors(schema)
            if name is None:
                return schema
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _component_schemas(model: type[BaseModel]) -> dict[str, dict]:
    """``model`` and the models it uses, as OpenAPI components; null allowed where it means
    the default (``NullMeansDefault``)."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    found = {**schema.pop("$defs", {}), model.__name__: schema}
    nullable = {m.__name__ for m in _models_within(model) if issubclass(m, NullMeansDefault)}
    for name in nullable & set(found):
        _allow_null(found[name])
    return found


def _models_within(model: type[BaseModel]) -> list[type[BaseModel]]:
    """``model`` and the pydantic models its fields name directly or in unions."""
    found = [model]
    for info in model.model_fields.values():
        for kind in (info.annotation, *getattr(info.annotation, "__args__", ())):
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                found.append(kind)
    return found


def _allow_null(schema: dict) -> None:
    required = set(schema.get("required", []))
    for name, prop in schema.get("properties", {}).items():
        if name not in required and not _accepts_null(prop):
            schema["properties"][name] = {"anyOf": [prop, {"type": "null"}]}


def _accepts_null(prop: dict) -> bool:
    return prop.get("type") == "null" or any(
        alt.get("type") == "null" for alt in prop.get("anyOf", [])
    )


def _drop_validation_errors(schema: dict) -> None:
    """FastAPI declares a 422 for routes with parameters; these routes never return one."""
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            operation.get("responses", {}).pop("422", None)
    for name in ("HTTPValidationError", "ValidationError"):
        schema.get("components", {}).get("schemas", {}).pop(name, None)
