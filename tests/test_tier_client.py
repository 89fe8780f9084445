"""TierClient: validated leading-run fetches, the circuit breaker, write-behind, open_tier."""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from clock_fixtures import FakeClock
from prefixcache.tier import (
    BlockFormat,
    DiskTier,
    KVTier,
    RedisTier,
    TierClient,
    TierError,
    open_tier,
)
from prefixcache.tier.codec import encode_value
from prefixcache.tier.seal import TierKeys

FMT = BlockFormat(hashlib.sha256(b"ns").digest(), "float32", "layer,kv", (4, 32), 4)
KEY = TierKeys(bytes(32)).current.for_salt(None)  # one tenant secret's key for these tests
OTHER = FMT._replace(namespace_digest=hashlib.sha256(b"other model").digest())


class FlakyTier(KVTier):
    """A DiskTier that can be switched off, or made to wait at a gate (a test double)."""

    medium = "disk"

    def __init__(self, inner: DiskTier) -> None:
        self.inner, self.down, self.calls = inner, False, 0
        self.error: type[Exception] = TierError
        self.gate: threading.Event | None = None
        self.entered = threading.Event()

    def _call(self) -> None:
        self.calls += 1
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(5)
        if self.down:
            raise self.error("switched off")

    def present(self, digests: Sequence[bytes]) -> int:
        self._call()
        return self.inner.present(digests)

    def get(self, digests: Sequence[bytes]) -> list[bytes | None]:
        return self.inner.get(digests)

    def put(self, digest: bytes, value: bytes, depth: int, ttl_seconds: float | None = None):
        self._call()
        return self.inner.put(digest, value, depth, ttl_seconds)

    def retain(self, digest: bytes, ttl_seconds: float) -> bool:
        self._call()
        return self.inner.retain(digest, ttl_seconds)

    def close(self) -> None:
        self.inner.close()


def digest(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def body(name: str) -> bytes:
    return hashlib.shake_256(name.encode()).digest(FMT.payload_bytes)


def store(tier: KVTier, name: str, depth: int = 0, fmt: BlockFormat = FMT) -> None:
    tier.put(digest(name), encode_value(fmt, digest(name), depth, body(name), KEY), depth)


@pytest.fixture
def flaky(tmp_path: Path) -> FlakyTier:
    return FlakyTier(DiskTier(tmp_path, 1 << 20))


def test_fetch_returns_the_leading_run(tmp_path: Path):
    with TierClient(DiskTier(tmp_path, 1 << 20), FMT) as client:
        for depth, name in enumerate(["a", "b", "d"]):
            store(client.backend, name, depth)
        got = client.fetch([digest(n) for n in "abcd"], KEY)
        assert [bytes(p) for p in got] == [body("a"), body("b")]
        stats = client.stats
        assert (stats.lookups, stats.hit_blocks, stats.miss_blocks, stats.loads) == (1, 2, 2, 1)
        assert stats.load_seconds > 0 and stats.errors == 0
        assert client.fetch([], KEY) == [] and client.stats.lookups == 1


def test_a_foreign_block_stops_the_run_and_stays(tmp_path: Path):
    with TierClient(DiskTier(tmp_path, 1 << 20), FMT) as client:
        store(client.backend, "a", 0)
        store(client.backend, "b", 1, fmt=OTHER)
        store(client.backend, "c", 2)
        assert len(client.fetch([digest(n) for n in "abc"], KEY)) == 1
        assert client.stats.rejected == {"namespace": 1}
        assert client.backend.present([digest("b")]) == 1  # another model's: not ours to delete


def test_a_value_under_the_wrong_key_is_rejected_and_discarded(tmp_path: Path):
    with TierClient(DiskTier(tmp_path, 1 << 20), FMT) as client:
        misfiled = encode_value(FMT, digest("b"), 0, body("b"), KEY)
        client.backend.put(digest("a"), misfiled, 0)
        assert client.fetch([digest("a")], KEY) == []
        assert client.stats.rejected == {"digest": 1}
        assert client.backend.present([digest("a")]) == 0


def test_start_fetch_runs_on_a_pool_thread(tmp_path: Path):
    with TierClient(DiskTier(tmp_path, 1 << 20), FMT) as client:
        store(client.backend, "a")
        future = client.start_fetch([digest("a"), digest("b")], KEY)
        assert [bytes(p) for p in future.result(timeout=5)] == [body("a")]
    assert client.start_fetch([digest("a")], KEY).result(timeout=1) == []  # closed: a miss


def test_breaker_opens_backs_off_and_closes(flaky: FlakyTier, caplog):
    clock = FakeClock(50.0)
    client = TierClient(
        flaky, FMT, failure_threshold=2, cooldown_seconds=1, max_cooldown_seconds=3, clock=clock
    )
    caplog.set_level(logging.INFO, logger="prefixcache.tier")
    flaky.down = True
    assert client.fetch([digest("a")], KEY) == [] and client.breaker_state == "closed"
    assert client.fetch([digest("a")], KEY) == [] and client.breaker_state == "open"
    calls = flaky.calls
    for _ in range(5):
        assert client.fetch([digest("a")], KEY) == []
    assert flaky.calls == calls  # open: the backend is left alone
    for cooldown in (1, 2, 3, 3):  # each failed probe doubles it, up to the maximum
        clock.now += cooldown - 0.01
        assert client.breaker_state == "open"
        clock.now += 0.01
        assert client.breaker_state == "half_open"
        assert client.fetch([digest("a")], KEY) == []
    flaky.down = False
    clock.now += 3
    store(flaky.inner, "a")
    assert len(client.fetch([digest("a")], KEY)) == 1 and client.breaker_state == "closed"
    warnings = [r for r in caplog.records if "circuit open" in r.getMessage()]
    closings = [r for r in caplog.records if "circuit closed" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert len(closings) == 1 and client.breaker_opens == 1
    assert client.stats.errors == 6
    client.close()


def test_a_success_resets_the_failure_count(flaky: FlakyTier):
    client = TierClient(flaky, FMT, failure_threshold=2)
    for down in (True, False, True, False, True):
        flaky.down = down
        client.fetch([digest("a")], KEY)
    assert client.breaker_state == "closed" and client.stats.errors == 3
    client.close()


def test_half_open_lets_exactly_one_probe_through(flaky: FlakyTier):
    clock = FakeClock(50.0)
    client = TierClient(flaky, FMT, failure_threshold=1, clock=clock)
    flaky.down = True
    client.fetch([digest("a")], KEY)
    flaky.down, flaky.gate = False, threading.Event()
    flaky.entered.clear()
    clock.now += 1.0
    probe = client.start_fetch([digest("a")], KEY)
    assert flaky.entered.wait(5)
    calls = flaky.calls
    assert client.fetch([digest("a")], KEY) == [] and flaky.calls == calls  # refused meanwhile
    flaky.gate.set()
    assert probe.result(timeout=5) == [] and client.breaker_state == "closed"
    client.close()


def test_unexpected_backend_exceptions_are_misses(flaky: FlakyTier):
    client = TierClient(flaky, FMT)
    flaky.down, flaky.error = True, RuntimeError
    assert client.fetch([digest("a")], KEY) == []
    assert client.stats.errors == 1
    client.close()


def test_full_queue_drops_and_counts_without_blocking(flaky: FlakyTier):
    client = TierClient(flaky, FMT, queue_blocks=2)
    release, entered, threads = threading.Event(), threading.Event(), []

    def slow_payload() -> bytes:
        threads.append(threading.current_thread().name)
        entered.set()
        release.wait(5)
        return body("a")

    assert client.submit_write(digest("a"), 0, slow_payload, KEY)
    assert entered.wait(5)  # the writer holds "a"; the queue is empty again
    assert client.submit_write(digest("b"), 1, body("b"), KEY)
    assert not client.submit_write(digest("b"), 1, body("b"), KEY)  # already queued: not twice
    assert client.submit_write(digest("c"), 2, lambda: body("c"), KEY)
    started = time.perf_counter()
    assert not client.submit_write(digest("d"), 3, body("d"), KEY)
    assert time.perf_counter() - started < 0.01
    assert client.stats.writes_dropped == 1
    assert not client.flush(0.05)
    release.set()
    assert client.flush(5)
    assert client.stats.writes == 3 and threads == ["tier-writer"]
    assert len(client.fetch([digest(n) for n in "abcd"], KEY)) == 3
    client.close()


def test_retention_rides_with_writes_and_on_its_own(flaky: FlakyTier):
    client = TierClient(flaky, FMT)
    gate = threading.Event()
    assert client.submit_write(digest("a"), 0, lambda: gate.wait(5) and body("a"), KEY)
    assert not client.submit_write(digest("a"), 0, body("a"), KEY, ttl_seconds=600.0)  # queued
    assert client.submit_retain(digest("absent"), 600.0)
    gate.set()
    assert client.flush(5)
    until = flaky.inner.retained_until(digest("a"))  # the mark came after the write
    assert until is not None and 590 <= until - time.time() <= 600
    assert client.present([digest("absent")]) == 0  # a retention never makes a block
    assert client.stats.writes == 1 and client.stats.errors == 0
    client.close()


def test_writer_survives_bad_payloads_and_skips_stored_blocks(flaky: FlakyTier):
    client = TierClient(flaky, FMT)

    def broken() -> bytes:
        raise MemoryError("tensor gone")

    client.submit_write(digest("a"), 0, broken, KEY)
    client.submit_write(digest("b"), 0, b"short", KEY)
    client.submit_write(digest("c"), 0, body("c"), KEY)
    assert client.flush(5)
    client.submit_write(digest("c"), 0, lambda: pytest.fail("stored blocks are not re-read"), KEY)
    assert client.flush(5)
    stats = client.stats
    assert (stats.errors, stats.writes) == (2, 1) and client.breaker_state == "closed"
    assert stats.bytes_written == len(flaky.inner.get([digest("c")])[0])
    client.close()


def test_backend_write_failures_feed_the_breaker(flaky: FlakyTier):
    client = TierClient(flaky, FMT, failure_threshold=2, cooldown_seconds=60)
    flaky.down = True
    for name in "ab":
        client.submit_write(digest(name), 0, body(name), KEY)
        assert client.flush(5)
    assert client.breaker_state == "open" and client.stats.errors == 2
    assert not client.submit_write(digest("c"), 0, body("c"), KEY)
    assert client.stats.writes_dropped == 1
    client.close()


def test_close_stops_the_writer_and_releases_the_backend(tmp_path: Path):
    client = TierClient(DiskTier(tmp_path, 1 << 20), FMT)
    client.submit_write(digest("a"), 0, body("a"), KEY)
    client.close()
    assert not client._writer.is_alive()
    assert not client.submit_write(digest("b"), 0, body("b"), KEY)
    assert client.fetch([digest("a")], KEY) == []
    with TierClient(DiskTier(tmp_path, 1 << 20), FMT) as again:  # the lock was released
        assert [bytes(p) for p in again.fetch([digest("a")], KEY)] == [body("a")]


def test_logs_carry_short_digests_only(tmp_path: Path, caplog):
    caplog.set_level(logging.DEBUG, logger="prefixcache.tier")
    with TierClient(DiskTier(tmp_path, 1 << 20), FMT) as client:
        store(client.backend, "a", fmt=OTHER)
        store(client.backend, "b")
        client.fetch([digest("a")], KEY)
        client.fetch([digest("b")], KEY)
    assert digest("a").hex()[:12] in caplog.text
    assert digest("a").hex()[:13] not in caplog.text and body("b").hex()[:16] not in caplog.text


def test_open_tier_disk_passes_options(tmp_path: Path):
    with open_tier(f"disk:{tmp_path}", FMT, max_bytes=12345, queue_blocks=7) as client:
        assert isinstance(client.backend, DiskTier) and client.backend.max_bytes == 12345
        assert client.queue_blocks == 7 and client.medium == "disk"


@pytest.mark.parametrize(
    ("spec", "url", "cluster"),
    [
        ("redis://127.0.0.1:6390/3", "redis://127.0.0.1:6390/3", False),
        ("rediss://:pw@cache.example:6380/0", "rediss://:pw@cache.example:6380/0", False),
        ("redis+cluster://10.0.0.5:7000", "redis://10.0.0.5:7000", True),
    ],
)
def test_open_tier_redis_forms(spec: str, url: str, cluster: bool):
    client = open_tier(spec, FMT, ttl_seconds=60, failure_threshold=5)
    assert isinstance(client.backend, RedisTier) and client.medium == "redis"
    assert (client.backend.url, client.backend.cluster) == (url, cluster)
    assert client.backend.ttl_seconds == 60 and client.breaker.failure_threshold == 5
    client.close()  # nothing connected yet: the client is made on first use


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "disk:",
        "/var/cache/kv",
        "memcached://h:1",
        "redis://:pw@:6379/0",
        "redis://h:port/0",
        "redis://h:6379/db",
        "redis+cluster://h:7000/2",
    ],
)
def test_open_tier_rejects_bad_specs(spec: str):
    with pytest.raises(ValueError, match="accepted forms") as caught:
        open_tier(spec, FMT)
    assert "disk:PATH" in str(caught.value) and "redis+cluster://" in str(caught.value)
    assert ":pw@" not in str(caught.value)


def test_bad_format_is_refused_up_front(tmp_path: Path):
    with pytest.raises(ValueError, match="namespace_digest"):
        open_tier(f"disk:{tmp_path}", FMT._replace(namespace_digest=b"short"))
    DiskTier(tmp_path, 1 << 20).close()  # the failed open released the directory


def test_present_counts_without_loading_and_never_raises(flaky: FlakyTier):
    client = TierClient(flaky, FMT)
    store(flaky.inner, "a", 0)
    store(flaky.inner, "b", 1)
    assert client.present([digest(n) for n in "abc"]) == 2
    assert client.stats.lookups == 0
    flaky.down = True
    assert client.present([digest("a")]) == 0 and client.stats.errors == 1
    client.close()
