"""The access log of the server and the router alike: health checks kept out, stored
response ids kept out.

A router asks every replica for ``/health`` and ``/metrics`` each second (and Prometheus
scrapes ``/metrics``), which would otherwise be most of each log. ``--log-health-checks``
keeps them. A stored response's id in a path (``GET /v1/responses/{id}``) is written
``{id}`` whatever the flags: ids are never logged.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterable, Mapping

HEALTH_CHECK_PATHS = frozenset({"/health", "/metrics"})
ACCESS_LOGGER = "uvicorn.access"  # uvicorn logs (client, method, path?query, version, status)
STORED_PREFIX = "/v1/responses/"  # then a response id, then maybe "/input_items"


def summed_waits(queue_seconds: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Seconds a request's prompts waited to be admitted, by reason, summed over them
    (sorted by reason; reasons they never waited for left out)."""
    total: dict[str, float] = {}
    for waits in queue_seconds:
        for reason, seconds in waits.items():
            total[reason] = total.get(reason, 0.0) + seconds
    return {reason: seconds for reason, seconds in sorted(total.items()) if seconds}


def waited_field(queue_seconds: Iterable[Mapping[str, float]]) -> str:
    """`` waited=step_time:0.42s,seats:0.10s``: why a request's prompts waited to be
    admitted, summed over them (empty if they never waited)."""
    parts = [f"{reason}:{seconds:.2f}s" for reason, seconds in summed_waits(queue_seconds).items()]
    return f" waited={','.join(parts)}" if parts else ""


class HealthCheckFilter(logging.Filter):
    """Drops uvicorn access-log records of ``HEALTH_CHECK_PATHS`` requests."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or len(args) < 3:
            return True
        return str(args[2]).partition("?")[0] not in HEALTH_CHECK_PATHS


class ResponseIdFilter(logging.Filter):
    """Rewrites a stored response's path in an access-log record with ``{id}`` for its id."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and str(args[2]).startswith(STORED_PREFIX):
            record.args = (*args[:2], without_response_id(str(args[2])), *args[3:])
        return True


def without_response_id(target: str) -> str:
    """``/v1/responses/<id>[/rest][?query]`` as ``/v1/responses/{id}[/rest]`` (no query:
    it may name an item)."""
    path = target.partition("?")[0]
    rest = path[len(STORED_PREFIX) :].partition("/")[2]
    return STORED_PREFIX + "{id}" + (f"/{rest}" if rest else "")


def add_health_log_flag(parser: argparse.ArgumentParser) -> None:
    """``--log-health-checks``, the same for ``serve`` and ``route``."""
    parser.add_argument(
        "--log-health-checks",
        action="store_true",
        help="keep /health and /metrics requests in the access log (default: left out, "
        "since routers poll them every second)",
    )


def quiet_health_checks(log_them: bool = False) -> None:
    """Keep health checks out of uvicorn's access log, unless ``log_them``, and response ids
    always (idempotent)."""
    logger = logging.getLogger(ACCESS_LOGGER)
    if not any(isinstance(f, ResponseIdFilter) for f in logger.filters):
        logger.addFilter(ResponseIdFilter())
    present = [f for f in logger.filters if isinstance(f, HealthCheckFilter)]
    if log_them:
        for old in present:
            logger.removeFilter(old)
    elif not present:
        logger.addFilter(HealthCheckFilter())
