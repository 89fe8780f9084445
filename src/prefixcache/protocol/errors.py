"""Error objects, and the handlers that answer with them (the server's and the router's).

The shape goes by route, decided here only: OpenAI's ``{"error": {"message", "type",
"param", "code"}}`` everywhere, Anthropic's ``{"type": "error", "error": {"type",
"message"}}`` on the Messages API (``ANTHROPIC_PATHS``).
"""

from __future__ import annotations

import json
import logging

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

log = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    503: "service_unavailable_error",
}
MESSAGES_PATH = "/v1/messages"
ANTHROPIC_PATHS = frozenset({MESSAGES_PATH, "/v1/messages/count_tokens"})  # Anthropic's shape
ANTHROPIC_ERROR_TYPES = {**ERROR_TYPES, 503: "overloaded_error"}  # the rest alike


def field_path(parts: tuple | list) -> str:
    """Where in a body a field is ("messages.0.content"); a client's key is cut to 40
    characters, so an error never echoes a huge one."""
    return ".".join(str(part)[:40] for part in parts) or "body"


def error_body(
    status: int, message: str, param: str | None = None, path: str | None = None
) -> dict:
    """The error object a client of the route at ``path`` parses."""
    if path in ANTHROPIC_PATHS:
        kind = ANTHROPIC_ERROR_TYPES.get(status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    kind = ERROR_TYPES.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def stream_error_event(status: int, message: str, path: str | None = None) -> str:
    """An error ending a stream, as one SSE event in the route's shape: OpenAI's ``data:``
    chunk then ``data: [DONE]``, or Anthropic's ``event: error`` (its streams have no
    ``[DONE]``). ``status`` picks the type: 503 (shutting down) is Anthropic's
    ``overloaded_error``, a failure (500) its ``api_error``."""
    body = json.dumps(error_body(status, message, path=path))
    if path in ANTHROPIC_PATHS:
        return f"event: error\ndata: {body}\n\n"
    return f"data: {body}\n\ndata: [DONE]\n\n"


def error_bytes(status: int, message: str, param: str | None = None) -> bytes:
    """The error object as a JSON body (for code below the framework: middleware, protocol)."""
    return json.dumps(error_body(status, message, param)).encode()


class ApiError(Exception):
    """An error the client caused, sent as an OpenAI-style ``error`` object."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.headers = headers or {}

    def __reduce__(self) -> tuple:
        """Pickled whole: a worker process raises it, the server answers it."""
        return (ApiError, (self.status, self.message, self.param, self.headers))

    def response(self, path: str | None = None) -> JSONResponse:
        """The error as a response to a request for ``path`` (its shape goes by route)."""
        body = error_body(self.status, self.message, self.param, path)
        return JSONResponse(body, status_code=self.status, headers=self.headers)


async def answer_api_error(request: Request, error: ApiError) -> JSONResponse:
    """The handler for ``ApiError``: async, so it needs no worker thread (answers in shutdown)."""
    return error.response(request.scope.get("path"))


async def answer_http_error(request: Request, error: HTTPException) -> JSONResponse:
    """Routing errors (unknown path 404, wrong method 405) as OpenAI error objects."""
    path = request.scope["path"]  # as routed; request.url would be rebuilt from Host
    if error.status_code == 405:
        message = f"method {request.method} is not allowed on {path}"
    elif error.status_code == 404:
        message = f"no such endpoint: {request.method} {path}"
    else:
        message = str(error.detail)
    response = ApiError(error.status_code, message).response(path)
    response.headers.update(error.headers or {})
    return response


def internal_error(request: Request, error: Exception) -> JSONResponse:
    """A bug of ours, not the client's input: log the type and path, never the body."""
    path = request.scope.get("path")
    log.error("internal error on %s: %s", path, type(error).__name__, exc_info=error)
    body = error_body(500, "internal server error", path=path)
    return JSONResponse(body, status_code=500)
