"""Health checks kept out of the access log, for the server and the router alike.

A router asks every replica for ``/health`` and ``/metrics`` each second (and Prometheus
scrapes ``/metrics``), which would otherwise be most of each log. ``--log-health-checks``
keeps them.
"""

from __future__ import annotations

import argparse
import logging

HEALTH_CHECK_PATHS = frozenset({"/health", "/metrics"})
ACCESS_LOGGER = "uvicorn.access"  # uvicorn logs (client, method, path?query, version, status)


class HealthCheckFilter(logging.Filter):
    """Drops uvicorn access-log records of ``HEALTH_CHECK_PATHS`` requests."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or len(args) < 3:
            return True
        return str(args[2]).partition("?")[0] not in HEALTH_CHECK_PATHS


def add_health_log_flag(parser: argparse.ArgumentParser) -> None:
    """``--log-health-checks``, the same for ``serve`` and ``route``."""
    parser.add_argument(
        "--log-health-checks",
        action="store_true",
        help="keep /health and /metrics requests in the access log (default: left out, "
        "since routers poll them every second)",
    )


def quiet_health_checks(log_them: bool = False) -> None:
    """Keep health checks out of uvicorn's access log, unless ``log_them`` (idempotent)."""
    logger = logging.getLogger(ACCESS_LOGGER)
    present = [f for f in logger.filters if isinstance(f, HealthCheckFilter)]
    if log_them:
        for old in present:
            logger.removeFilter(old)
    elif not present:
        logger.addFilter(HealthCheckFilter())
