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

TTLs: with ``ttl_seconds`` every value is written with that expiry, and a read refreshes it.
A retained block (the cache's retention mark, ``put(..., ttl_seconds)``) is written with
``max(tier TTL, ceil(retention TTL))``, and ``retain`` lengthens a stored key's TTL to that.
Neither a read nor a retention ever shortens a TTL: both run one small Lua script per key
(``EVAL``: ``PTTL``, then ``PEXPIRE`` only if the key's TTL is below the target; a key
without a TTL keeps none). It is atomic on the server, so replicas refreshing and retaining
the same key concurrently cannot shorten it, and it costs no extra round trip (Redis 6.2,
which has no ``EXPIRE ... GT``, runs it too). The ACL the tier needs is
``+exists +get +set +del +eval +pttl +pexpire`` on ``key_prefix*``.

Clients fail fast: no retries by default and a short socket timeout, because a miss costs
a recompute while a stalled read stalls a whole batch. Errors surface as ``TierError``.
"""

from __future__ import annotations

import logging
import math
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
# KEYS[1]'s TTL becomes at least ARGV[1] ms (a key without a TTL keeps none); its old PTTL.
EXTEND = """local left = redis.call('PTTL', KEYS[1])
if left >= 0 and left < tonumber(ARGV[1]) then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end
return left"""
# GET KEYS[1], then the same extension (a read never shortens a retained block's TTL).
READ = """local value = redis.call('GET', KEYS[1])
if value then
  local left = redis.call('PTTL', KEYS[1])
  if left >= 0 and left < tonumber(ARGV[1]) then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end
end
return value"""


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

    def expiry(self, ttl_seconds: float | None) -> int | None:
        """The EX of a block retained ``ttl_seconds`` (None: unretained); None: no expiry."""
        if self.ttl_seconds is None or ttl_seconds is None:
            return self.ttl_seconds
        return max(self.ttl_seconds, math.ceil(ttl_seconds))

    def get(self, digests: Sequence[bytes]) -> list[bytes | None]:
        """One pipeline of GET (the READ script, refreshing a shorter TTL, when one is set)."""
        if not digests:
            return []
        with self._errors("get"):
            pipe = self._redis().pipeline(transaction=False)
            for digest in digests:
                if self.ttl_seconds is None:
                    pipe.get(self.key(digest))
                else:
                    # execute_command: a ClusterPipeline has no eval(), but routes EVAL by key
                    pipe.execute_command("EVAL", READ, 1, self.key(digest), self.ttl_seconds * 1000)
            return pipe.execute()

    def retain(self, digest: bytes, ttl_seconds: float) -> bool:
        """Lengthen a stored block's TTL to ``expiry(ttl_seconds)`` (the EXTEND script)."""
        target = max(self.ttl_seconds or 0, math.ceil(ttl_seconds)) * 1000
        with self._errors("retain"):
            return self._redis().eval(EXTEND, 1, self.key(digest), target) != -2

    def put(
        self, digest: bytes, value: bytes, depth: int, ttl_seconds: float | None = None
    ) -> bool:
        """One ``SET key value NX [EX ttl]``; False if the key exists (then a retained block's
        TTL is lengthened) or Redis is full."""
        key = self.key(digest)
        try:
            with self._errors("put"):
                if self._redis().set(key, value, nx=True, ex=self.expiry(ttl_seconds)):
                    return True
            if ttl_seconds is not None:
                self.retain(digest, ttl_seconds)
            return False
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
