"""The shared tier: one Redis string per block, readable by every replica.

Each block is ONE key, ``key_prefix + hex(digest)``, whose value is the self-describing
encoded block (``codec``): written with a single ``SET ... NX`` (a second writer does not
rewrite it; there is never a separate metadata key), read with one pipeline of ``GET``s.
The same code serves ``redis.Redis`` and ``redis.cluster.RedisCluster`` (a pipeline there
is split per node); only construction differs.

Eviction is Redis' job. Give the server a memory cap and an LRU policy, e.g.::

    maxmemory 8gb
    maxmemory-policy allkeys-lru

With ``noeviction`` a full server refuses writes (counted as not written, not as errors).
Clients fail fast: no retries by default and a short socket timeout, because a miss costs
a recompute while a stalled read stalls a whole batch. Errors surface as ``TierError``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import OutOfMemoryError, RedisClusterException, RedisError, ResponseError
from redis.retry import Retry

from prefixcache.tier.base import KVTier, TierError

logger = logging.getLogger(__name__)
_ERRORS = (RedisError, RedisClusterException)


def _is_full(error: BaseException | None) -> bool:
    """Redis refused a write for lack of memory (``maxmemory`` with ``noeviction``)."""
    return isinstance(error, OutOfMemoryError) or (
        isinstance(error, ResponseError) and str(error).startswith("OOM")
    )


class RedisTier(KVTier):
    """Blocks in Redis or Redis Cluster; thread-safe (redis-py pools its connections)."""

    medium = "redis"

    def __init__(
        self,
        url: str,
        *,
        cluster: bool = False,
        key_prefix: bytes = b"prefixcache:kv:",
        socket_timeout: float = 0.25,
        ttl_seconds: int | None = None,
        retries: int = 0,
        **redis_options: Any,
    ) -> None:
        self.url, self.cluster, self.key_prefix = url, cluster, key_prefix
        self.ttl_seconds = ttl_seconds
        self._options = {
            "socket_timeout": socket_timeout,
            "socket_connect_timeout": socket_timeout,
            "retry": Retry(NoBackoff(), retries),
            **redis_options,
        }
        self._client: redis.Redis | RedisCluster | None = None
        self._connect_lock = threading.Lock()
        self._warned_full = False

    def _redis(self) -> redis.Redis | RedisCluster:
        """The client, made on first use: a cluster's construction already talks to it."""
        if self._client is None:
            with self._connect_lock:
                if self._client is None:
                    factory = RedisCluster if self.cluster else redis.Redis
                    self._client = factory.from_url(self.url, **self._options)
        return self._client

    @contextmanager
    def _errors(self, operation: str) -> Iterator[None]:
        try:
            yield
        except _ERRORS as error:
            raise TierError(f"redis tier {operation}: {type(error).__name__}: {error}") from error

    def key(self, digest: bytes) -> bytes:
        """The Redis key of one block."""
        return self.key_prefix + digest.hex().encode()

    def present(self, digests: Sequence[bytes]) -> int:
        """One pipeline of EXISTS; the count of leading digests found."""
        if not digests:
            return 0
        with self._errors("present"):
            pipe = self._redis().pipeline(transaction=False)
            for digest in digests:
                pipe.exists(self.key(digest))
            found = pipe.execute()
        for count, exists in enumerate(found):
            if not exists:
                return count
        return len(digests)

    def get(self, digests: Sequence[bytes]) -> list[bytes | None]:
        """One pipeline of GET (GETEX refreshing the TTL when one is set)."""
        if not digests:
            return []
        with self._errors("get"):
            pipe = self._redis().pipeline(transaction=False)
            for digest in digests:
                if self.ttl_seconds is None:
                    pipe.get(self.key(digest))
                else:
                    pipe.getex(self.key(digest), ex=self.ttl_seconds)
            return pipe.execute()

    def put(self, digest: bytes, value: bytes, depth: int) -> bool:
        """One ``SET key value NX [EX ttl]``; False if the key exists or Redis is full."""
        key = self.key(digest)
        try:
            with self._errors("put"):
                return bool(self._redis().set(key, value, nx=True, ex=self.ttl_seconds))
        except TierError as error:
            if not _is_full(error.__cause__):
                raise
            if not self._warned_full:
                logger.warning("redis tier is full and refuses writes: set maxmemory-policy")
                self._warned_full = True
            return False

    def discard(self, digests: Sequence[bytes]) -> None:
        """Delete damaged values (one DEL per key: keys of a cluster span slots)."""
        if not digests:
            return
        with self._errors("discard"):
            pipe = self._redis().pipeline(transaction=False)
            for digest in digests:
                pipe.delete(self.key(digest))
            pipe.execute()

    def close(self) -> None:
        """Close the client's connections."""
        client, self._client = self._client, None
        if client is not None:
            client.close()
