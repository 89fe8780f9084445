"""``GET /admin/prefixes`` (admin keys only): where the cached chains fork and end, shared ones
first, by digest and depth, for ``prefixcache top``. Never token ids or text: a digest names
a prefix, it does not show it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI, Request

from prefixcache.cache.chains import shared_prefixes
from prefixcache.protocol import openapi
from prefixcache.protocol.front import get_and_head
from prefixcache.protocol.openapi import responses
from prefixcache.protocol.query import query_limit

if TYPE_CHECKING:
    from prefixcache.engine.engine import LLMEngine
    from prefixcache.server.app import Server

PREFIXES = "/admin/prefixes"
DEFAULT_LIMIT, MAX_LIMIT = 10, 100
DIGEST_CHARS = 12  # hex characters of a digest shown: enough to tell prefixes apart


def add_cache_routes(app: FastAPI, server: Server) -> None:
    """The admin view of what the pool caches."""

    @get_and_head(
        app,
        PREFIXES,
        openapi_extra=openapi.PREFIXES_QUERY,
        responses=responses(openapi.PrefixList, 400, 401, 403),
    )
    async def prefixes(request: Request) -> dict:
        """Up to ``limit`` (default 10) forks and ends of the cached chains, shared first:
        digest, blocks, tokens, branches, holders."""
        limit = query_limit(request.query_params.get("limit"), DEFAULT_LIMIT, MAX_LIMIT)
        return await server.async_engine.run_in_engine(lambda engine: prefix_list(engine, limit))


def prefix_list(engine: LLMEngine, limit: int) -> dict:
    """The answer, built on the engine thread (it walks the live index)."""
    manager = engine.manager
    size = manager.block_size
    chains = shared_prefixes(manager.pool, limit)
    rows = [
        {
            "digest": chain.digest.hex()[:DIGEST_CHARS],
            "blocks": chain.blocks,
            "tokens": chain.blocks * size,
            "branches": chain.branches,
            "holders": chain.holders,
        }
        for chain in chains
    ]
    return {"block_size": size, "prefixes": rows}
