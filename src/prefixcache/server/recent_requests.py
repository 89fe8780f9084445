"""The last finished requests, by response id, for ``GET /admin/requests/{request_id}`` and
``prefixcache explain --served``: counts, times and why each waited; never text or token ids.

Recorded where the access-log line is written (``app._Done``); the oldest record goes once
``limit`` are kept.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from fastapi import FastAPI

from prefixcache.protocol import openapi
from prefixcache.protocol.access_log import summed_waits
from prefixcache.protocol.errors import ApiError
from prefixcache.protocol.front import get_and_head
from prefixcache.protocol.openapi import responses

if TYPE_CHECKING:
    from prefixcache.engine.request import RequestOutput
    from prefixcache.server.app import Server

REQUESTS = "/admin/requests/{request_id}"
DEFAULT_LIMIT = 1024


class RecentRequests:
    """Up to ``limit`` records of finished requests, the newest last."""

    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        self.limit = limit
        self.records: OrderedDict[str, dict] = OrderedDict()

    def add(self, record: dict) -> None:
        """Keep ``record`` under its ``request_id``; drop the oldest past ``limit``."""
        self.records[record["request_id"]] = record
        self.records.move_to_end(record["request_id"])
        while len(self.records) > self.limit:
            self.records.popitem(last=False)

    def get(self, request_id: str) -> dict:
        """The record of ``request_id``; a 404 saying how many are kept if it is not one."""
        record = self.records.get(request_id)
        if record is None:
            raise ApiError(
                404,
                f"no finished request {request_id!r} here: this server keeps only the last "
                f"{self.limit} finished requests",
                "request_id",
            )
        return record


def request_record(
    request_id: str,
    tenant: str,
    endpoint: str,
    priority: int,
    status: str,
    parts: Sequence[RequestOutput],
) -> dict:
    """What a finished request's prompts add up to (the access log's numbers, and times)."""
    cached = sum(p.num_cached_tokens for p in parts)
    tier = sum(p.num_tier_tokens for p in parts)
    return {
        "request_id": request_id,
        "tenant": tenant,
        "endpoint": endpoint,
        "status": status,
        "priority": priority,
        "prompts": len(parts),
        "prompt_tokens": sum(len(p.prompt_token_ids) for p in parts),
        "cached_tokens": cached,
        "pool_tokens": cached - tier,
        "tier_tokens": tier,
        "completion_tokens": sum(len(o.token_ids) for p in parts for o in p.outputs),
        "ttft_seconds": _ttft(parts),
        "total_seconds": _total(parts),
        "queue_seconds": _waits(parts),
    }


def _ttft(parts: Sequence[RequestOutput]) -> float | None:
    """From the first prompt's arrival to the first token of any (None: no token came)."""
    firsts = [p.metrics.first_token_time for p in parts if p.metrics.first_token_time]
    if not parts or not firsts:
        return None
    return round(min(firsts) - min(p.metrics.arrival_time for p in parts), 6)


def _total(parts: Sequence[RequestOutput]) -> float | None:
    """From the first prompt's arrival to the last one's end (now, if one did not end)."""
    if not parts:
        return None
    ends = [p.metrics.finished_time or time.perf_counter() for p in parts]
    return round(max(ends) - min(p.metrics.arrival_time for p in parts), 6)


def _waits(parts: Sequence[RequestOutput]) -> dict[str, float]:
    """Seconds waited before admission by reason, summed over the prompts (no zeros)."""
    waits = summed_waits(part.metrics.queue_seconds for part in parts)
    return {reason: round(seconds, 6) for reason, seconds in waits.items()}


def add_request_routes(app: FastAPI, server: Server) -> None:
    """``GET /admin/requests/{request_id}`` (admin keys only)."""

    @get_and_head(app, REQUESTS, responses=responses(openapi.ServedRequest, 401, 403, 404))
    async def served_request(request_id: str) -> dict:
        """A recently finished request: tokens, cache hits, times, and why it waited."""
        return server.recent.get(request_id)
