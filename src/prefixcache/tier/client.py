"""The engine-facing façade over one tier backend: validated reads, write-behind, breaker.

Reads never raise: a backend failure is a miss, counted, and feeds a circuit breaker that
stops calling a dead store for a while (a miss costs a recompute; a hung store would stall
every batch). Writes are queued and done by one daemon thread, so the engine never waits
for a store; a full queue or an open breaker drops the write and counts it.
Logs carry short digests and counts only, never payloads or token ids.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

from prefixcache.tier.base import CORRUPT_REASONS, BlockFormat, KVTier, TierStats, TierValueError
from prefixcache.tier.codec import check_format, decode_value, encode_value
from prefixcache.tier.seal import SealKey

logger = logging.getLogger(__name__)
T = TypeVar("T")
QUEUE_BLOCKS = 256  # writes waiting for the writer thread, at most (more are dropped)
PayloadSource = bytes | bytearray | memoryview | Callable[[], bytes | bytearray | memoryview]


def short(digest: bytes) -> str:
    """A digest as 12 hex digits, for logs."""
    return digest.hex()[:12]


@dataclass(slots=True)
class CircuitBreaker:
    """Closed -> open after ``failure_threshold`` consecutive failures -> half-open probe.

    Open, every call is refused until the cooldown ends; then one call goes through. Its
    success closes the breaker, its failure re-opens it with the cooldown doubled.
    """

    failure_threshold: int
    cooldown_seconds: float
    max_cooldown_seconds: float
    clock: Callable[[], float]
    name: str = "tier"
    failures: int = 0  # consecutive
    opens: int = 0
    opened_at: float | None = None  # None while closed
    cooldown: float = 0.0
    probing: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def state(self) -> str:
        """'closed', 'open', or 'half_open' (cooldown over: the next call probes)."""
        with self._lock:
            if self.opened_at is None:
                return "closed"
            over = self.clock() >= self.opened_at + self.cooldown
            return "half_open" if self.probing or over else "open"

    def allow(self) -> bool:
        """May a call go to the backend now? In half-open state only one may."""
        with self._lock:
            if self.opened_at is None:
                return True
            if self.probing or self.clock() < self.opened_at + self.cooldown:
                return False
            self.probing = True
            return True

    def success(self) -> None:
        """A backend call worked: reset the count, close if open."""
        with self._lock:
            self.failures = 0
            if self.opened_at is None:
                return
            self.opened_at, self.probing = None, False
        logger.info("%s tier reachable again: circuit closed", self.name)

    def failure(self) -> None:
        """A backend call failed: open at the threshold; a failed probe doubles the cooldown."""
        with self._lock:
            self.failures += 1
            if self.opened_at is not None:
                if self.probing:
                    self.probing = False
                    self.cooldown = min(self.cooldown * 2, self.max_cooldown_seconds)
                    self.opened_at = self.clock()
                    logger.debug("%s tier still down: retry in %.1fs", self.name, self.cooldown)
                return  # otherwise a late failure of a call let through while closed
            if self.failures < self.failure_threshold:
                return
            self.opened_at, self.cooldown = self.clock(), self.cooldown_seconds
            self.opens += 1
        logger.warning(
            "%s tier failed %d times in a row: circuit open, retry in %.1fs",
            self.name,
            self.failures,
            self.cooldown,
        )


class Chain(NamedTuple):
    """The same blocks under other digests and key (a previous secret's, during rotation)."""

    digests: list[bytes]
    key: SealKey


@dataclass(slots=True)
class _Write:
    digest: bytes
    depth: int
    source: PayloadSource | None  # None: only extend a stored block's retention
    key: SealKey | None
    ttl_seconds: float | None = None  # the cache's retention mark, seconds left
    announce: bool = True  # tell ``on_written`` once stored


class TierClient:
    """What the engine calls: ``fetch``/``start_fetch`` to load, ``submit_write`` to store."""

    def __init__(
        self,
        backend: KVTier,
        fmt: BlockFormat,
        *,
        failure_threshold: int = 3,
        cooldown_seconds: float = 1.0,
        max_cooldown_seconds: float = 30.0,
        queue_blocks: int = QUEUE_BLOCKS,
        clock: Callable[[], float] = time.monotonic,
        fetch_threads: int = 2,
    ) -> None:
        check_format(fmt)
        self.backend, self.fmt, self.queue_blocks = backend, fmt, queue_blocks
        self.on_written: Callable[[bytes], None] | None = None  # after each stored block
        self.breaker = CircuitBreaker(
            failure_threshold, cooldown_seconds, max_cooldown_seconds, clock, backend.medium
        )
        self._stats = TierStats()
        self._stats_lock = threading.Lock()
        self._closed = False
        self._pool = ThreadPoolExecutor(fetch_threads, thread_name_prefix="tier-fetch")
        self._queue: deque[_Write] = deque()
        self._queued: set[bytes] = set()  # digests waiting or being written
        self._busy = False
        self._cond = threading.Condition()
        self._writer = threading.Thread(target=self._drain, name="tier-writer", daemon=True)
        self._writer.start()

    @property
    def medium(self) -> str:
        """The backend's medium name, for KV events ("disk" or "redis")."""
        return self.backend.medium

    @property
    def stats(self) -> TierStats:
        """A consistent copy of the counters (evictions and refused files: the backend's)."""
        with self._stats_lock:
            snapshot = TierStats(**self._stats.as_dict())
        snapshot.evictions = self.backend.evictions
        snapshot.rejected_files = self.backend.rejected_files
        return snapshot

    @property
    def breaker_state(self) -> str:
        """'closed', 'open' or 'half_open'."""
        return self.breaker.state

    @property
    def breaker_opens(self) -> int:
        """How many times the breaker has opened."""
        return self.breaker.opens

    def _count(self, **deltas: float) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + delta)

    def _reject(self, reason: str) -> None:
        with self._stats_lock:
            self._stats.rejected[reason] = self._stats.rejected.get(reason, 0) + 1

    def _failed(self, operation: str, error: BaseException) -> None:
        """Count a backend failure and tell the breaker."""
        self._count(errors=1)
        self.breaker.failure()
        logger.debug("%s tier %s failed: %s", self.medium, operation, error)

    # -- reads ------------------------------------------------------------------------

    def fetch(
        self, digests: Sequence[bytes], key: SealKey, depth0: int = 0, fallback: Chain | None = None
    ) -> list[memoryview]:
        """Payloads of the longest leading run of ``digests`` stored, valid and opening under
        ``key``; never raises. ``depth0`` is the chain position of ``digests[0]`` (for logs).
        Past the run, ``fallback`` (the same blocks under a previous secret) may extend it.
        """
        digests = list(digests)
        if not digests:
            return []
        try:
            payloads = self._fetch(digests, key, depth0)
            if fallback is not None and len(payloads) < len(digests):
                rest = fallback.digests[len(payloads) : len(digests)]
                payloads += self._fetch(rest, fallback.key, depth0 + len(payloads)) if rest else []
            return payloads
        except Exception:  # a bug, not an outage: still a miss, never the engine's problem
            logger.exception("%s tier fetch failed unexpectedly", self.medium)
            self._count(errors=1)
            return []

    def _fetch(self, digests: list[bytes], key: SealKey, depth0: int) -> list[memoryview]:
        if self._closed or not self.breaker.allow():
            self._count(lookups=1, miss_blocks=len(digests))
            return []
        start = time.perf_counter()
        try:
            found = self.backend.present(digests)
            values = self.backend.get(digests[:found]) if found else []
        except Exception as error:
            self._failed("fetch", error)
            self._count(lookups=1, miss_blocks=len(digests))
            return []
        self.breaker.success()
        payloads = self._decode(digests, values, key)
        elapsed = time.perf_counter() - start
        self._count(
            lookups=1,
            hit_blocks=len(payloads),
            miss_blocks=len(digests) - len(payloads),
            loads=1 if values else 0,
            load_seconds=elapsed if values else 0.0,
            bytes_read=sum(len(value) for value in values if value is not None),
        )
        if payloads:
            logger.debug("%s tier hit %d blocks at depth %d", self.medium, len(payloads), depth0)
        return payloads

    def _decode(
        self, digests: list[bytes], values: list[bytes | None], key: SealKey
    ) -> list[memoryview]:
        """Open values in order, stopping at the first absent or rejected one."""
        payloads = []
        for digest, value in zip(digests, values, strict=False):
            if value is None:
                break
            try:
                payloads.append(decode_value(self.fmt, digest, value, key))
            except TierValueError as error:
                self._reject(error.reason)
                logger.debug("%s tier rejected %s: %s", self.medium, short(digest), error)
                if error.reason in CORRUPT_REASONS:
                    self._discard(digest)
                break
        return payloads

    def _discard(self, digest: bytes) -> None:
        """Delete a damaged value so that the next write of this block replaces it."""
        try:
            self.backend.discard([digest])
        except Exception as error:
            self._failed("discard", error)

    def present(self, digests: Sequence[bytes]) -> int:
        """How many leading digests the store holds (no payload moved); 0 on any failure."""
        if self._closed or not digests or not self.breaker.allow():
            return 0
        try:
            found = self.backend.present(list(digests))
        except Exception as error:
            self._failed("present", error)
            return 0
        self.breaker.success()
        return found

    def start_fetch(
        self, digests: Sequence[bytes], key: SealKey, depth0: int = 0, fallback: Chain | None = None
    ) -> Future[list[memoryview]]:
        """``fetch`` on a pool thread, so the caller can overlap it and give up at a deadline."""
        return self.start(self.fetch, [], list(digests), key, depth0, fallback)

    def start(self, reads: Callable[..., T], closed: T, *args: object) -> Future[T]:
        """``reads(*args)`` (calls of ``fetch``) on a pool thread; ``closed`` at once once the
        client is closed."""
        try:
            if not self._closed:
                return self._pool.submit(reads, *args)
        except RuntimeError:  # the pool shut down meanwhile
            pass
        done: Future[T] = Future()
        done.set_result(closed)
        return done

    # -- writes -----------------------------------------------------------------------

    def submit_write(
        self,
        digest: bytes,
        depth: int,
        payload_source: PayloadSource,
        key: SealKey,
        ttl_seconds: float | None = None,
        announce: bool = True,
    ) -> bool:
        """Queue one block, to be sealed under ``key``, for the writer thread; never blocks.
        False if not queued.

        ``payload_source`` is the block's bytes or a zero-argument callable returning
        them, evaluated later on the writer thread: it must read KV that stays valid until
        then (a copy, or a block the engine keeps from being reused). ``ttl_seconds``: the
        block is retained that long; a copy already stored gets its retention extended.
        ``announce``: call ``on_written`` once it is stored (off: a value no event names).
        """
        with self._cond:
            if self._closed:
                return False
            if digest in self._queued:  # written already: a mark on it comes after the write
                if ttl_seconds is not None:
                    self._enqueue(_Write(digest, depth, None, None, ttl_seconds))
                return False
            return self._enqueue(_Write(digest, depth, payload_source, key, ttl_seconds, announce))

    def submit_retain(self, digest: bytes, ttl_seconds: float) -> bool:
        """Queue a retention extension of a block the store may already hold (no payload:
        an absent block stays absent); never blocks. False if not queued."""
        with self._cond:
            if self._closed:
                return False
            return self._enqueue(_Write(digest, 0, None, None, ttl_seconds))

    def _enqueue(self, item: _Write) -> bool:
        """Append under ``_cond``, unless the queue is full or the breaker open (counted)."""
        if len(self._queue) >= self.queue_blocks or self.breaker.state == "open":
            self._count(writes_dropped=1)
            return False
        self._queue.append(item)
        if item.source is not None:
            self._queued.add(item.digest)
        self._cond.notify()
        return True

    def _drain(self) -> None:
        """The writer thread: take queued blocks one at a time until closed."""
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                item = self._queue.popleft()
                self._busy = True
            try:
                self._write(item)
            except Exception:
                logger.exception("%s tier writer failed on %s", self.medium, short(item.digest))
            finally:
                with self._cond:
                    self._busy = False
                    if item.source is not None:
                        self._queued.discard(item.digest)
                    self._cond.notify_all()

    def _write(self, item: _Write) -> None:
        """Seal and store one block, unless the store already has it or is down."""
        if not self.breaker.allow():
            self._count(writes_dropped=1)
            return
        try:
            if item.source is None or self.backend.present([item.digest]):
                if item.ttl_seconds is not None:  # stored already: only its retention grows
                    self.backend.retain(item.digest, item.ttl_seconds)
                self.breaker.success()
                return
        except Exception as error:
            self._failed("write", error)
            return
        value = self._encode(item)
        if value is None:
            return
        try:
            written = self.backend.put(item.digest, value, item.depth, item.ttl_seconds)
        except Exception as error:
            self._failed("write", error)
            return
        self.breaker.success()
        if written:
            self._count(writes=1, bytes_written=len(value))
            if self.on_written is not None and item.announce:
                self.on_written(item.digest)

    def _encode(self, item: _Write) -> bytes | None:
        """The sealed value of a queued block (its payload closure runs here), or None."""
        try:
            payload = item.source() if callable(item.source) else item.source
            assert payload is not None and item.key is not None
            return encode_value(self.fmt, item.digest, item.depth, payload, item.key)
        except Exception:
            logger.exception("%s tier cannot encode block %s", self.medium, short(item.digest))
            self._count(errors=1)
            return None

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is done; False if ``timeout`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self, flush_timeout: float = 1.0) -> None:
        """Finish queued writes (up to ``flush_timeout``), stop the threads, close the backend."""
        if self._closed:
            return
        self.flush(flush_timeout)
        with self._cond:
            self._closed = True
            self._count(writes_dropped=len(self._queue))
            self._queued.difference_update(item.digest for item in self._queue)
            self._queue.clear()
            self._cond.notify_all()
        self._writer.join(timeout=5.0)
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.backend.close()

    def __enter__(self) -> TierClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
