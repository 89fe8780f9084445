"""The hardened HTTP front the server and the router share: one guard, one error shape, one
uvicorn setup.

``install_front`` puts ``RequestGuard`` (431, auth on the dispatched route, 429, 413, 408)
before the app and answers every error, 404 and 405 included, with an OpenAI error object;
``uvicorn_config`` adds the head deadline (``GuardedH11Protocol``: 408, JSON 400/431 for
malformed HTTP), the header size limit and the keep-alive timeout.
"""

from __future__ import annotations

from collections.abc import Callable

import uvicorn
from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.routing import BaseRoute

from prefixcache.protocol.admission import InFlight
from prefixcache.protocol.auth import Tenants
from prefixcache.protocol.errors import (
    ApiError,
    answer_api_error,
    answer_http_error,
    internal_error,
)
from prefixcache.protocol.guard import RequestGuard, RoutePolicy
from prefixcache.protocol.limits import KEEP_ALIVE_TIMEOUT, MAX_HEADER_BYTES, Limits
from prefixcache.protocol.slow_client import guarded_protocol


def install_front(
    app: FastAPI, routes: list[BaseRoute], tenants: Tenants, policy: RoutePolicy,
    limits: Limits, in_flight: InFlight, on_aborted_read: Callable[[], None] | None = None,
) -> None:  # fmt: skip
    """The guard before ``app`` (over its ``routes``), and error objects for every error."""
    app.add_exception_handler(ApiError, answer_api_error)
    app.add_exception_handler(HTTPException, answer_http_error)
    app.add_exception_handler(Exception, internal_error)
    app.add_middleware(
        RequestGuard,
        routes=routes,
        tenants=tenants,
        policy=policy,
        limits=limits,
        in_flight=in_flight,
        on_aborted_read=on_aborted_read,
    )


def uvicorn_config(
    app: FastAPI, host: str, port: int, read_timeout: float, **options: object
) -> uvicorn.Config:
    """uvicorn with the guarded protocol: a deadline per request head, 431 past its size."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=guarded_protocol(read_timeout),
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        timeout_keep_alive=KEEP_ALIVE_TIMEOUT,
        loop="asyncio",  # the same loop whether or not uvloop came with an extra (Ray's)
        **options,
    )


def get_and_head(app: FastAPI, path: str, **options: object) -> Callable:
    """Register a handler for GET and for HEAD (HEAD kept out of the schema: one
    operation id per route)."""

    def register(handler: Callable) -> Callable:
        app.add_api_route(path, handler, methods=["GET"], **options)
        app.add_api_route(path, handler, methods=["HEAD"], include_in_schema=False, **options)
        return handler

    return register
