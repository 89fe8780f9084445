"""RedisTier against real redis-server processes: single-key SETs, pipelines, outages."""

from __future__ import annotations

import functools
import hashlib
import time
from collections.abc import Iterator

import pytest
import redis.connection

from clock_fixtures import FakeClock
from prefixcache.tier import BlockFormat, RedisTier, TierClient, TierError, open_tier
from prefixcache.tier.codec import encode_value
from prefixcache.tier.seal import TierKeys
from redis_fixtures import RedisProcess, redis_cluster, redis_server

FMT = BlockFormat(hashlib.sha256(b"ns").digest(), "float32", "layer,kv", (4, 32), 4)
KEY = TierKeys(bytes(32)).current.for_salt(None)  # one tenant secret's key for these tests
PREFIX = b"prefixcache:kv:"


def digest(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def body(name: str) -> bytes:
    return hashlib.shake_256(name.encode()).digest(FMT.payload_bytes)


def value(name: str, depth: int = 0) -> bytes:
    return _sealed(name, depth)


@functools.cache  # a sealed value has a random nonce: the same block gives the same bytes
def _sealed(name: str, depth: int) -> bytes:
    return encode_value(FMT, digest(name), depth, body(name), KEY)


@pytest.fixture(scope="module")
def shared_server() -> Iterator[RedisProcess]:
    with redis_server() as server:
        yield server


@pytest.fixture
def server(shared_server: RedisProcess) -> RedisProcess:
    with shared_server.client() as client:
        client.flushall()
    return shared_server


def test_put_get_present_one_key_per_block(server: RedisProcess):
    tier = RedisTier(server.url)
    names = ["a", "b", "c"]
    for depth, name in enumerate(names):
        assert tier.put(digest(name), value(name, depth), depth)
    assert not tier.put(digest("a"), value("b"), 0)  # NX: the first writer wins
    assert tier.present([digest(n) for n in names]) == 3
    assert tier.present([digest("a"), digest("zz"), digest("c")]) == 1
    assert tier.get([digest("c"), digest("zz")]) == [value("c", 2), None]
    with server.client() as client:
        assert client.dbsize() == 3  # no metadata keys beside the blocks
        assert set(client.keys("*")) == {PREFIX + digest(n).hex().encode() for n in names}
        assert client.get(PREFIX + digest("a").hex().encode()) == value("a")
        assert client.ttl(PREFIX + digest("a").hex().encode()) == -1
    tier.close()


def test_ttl_is_set_and_refreshed_by_reads(server: RedisProcess):
    tier = RedisTier(server.url, ttl_seconds=100)
    tier.put(digest("a"), value("a"), 0)
    key = PREFIX + digest("a").hex().encode()
    with server.client() as client:
        assert 95 <= client.ttl(key) <= 100
        client.expire(key, 5)
        assert tier.get([digest("a")]) == [value("a")]
        assert client.ttl(key) > 5
    tier.close()


def test_reads_of_many_blocks_are_one_round_trip(server: RedisProcess, monkeypatch):
    tier = RedisTier(server.url)
    names = [f"n{i}" for i in range(100)]
    for depth, name in enumerate(names):
        tier.put(digest(name), value(name, depth), depth)
    sends = []
    original = redis.connection.Connection.send_packed_command

    def counting(self, command, check_health=True):
        sends.append(1)
        return original(self, command, check_health)

    monkeypatch.setattr(redis.connection.Connection, "send_packed_command", counting)
    assert tier.present([digest(n) for n in names]) == 100
    assert len(sends) == 1
    values = tier.get([digest(n) for n in names])
    assert len(sends) == 2
    assert values == [value(n, d) for d, n in enumerate(names)]
    tier.close()


def test_client_writes_behind_and_a_fresh_client_reads(server: RedisProcess):
    with open_tier(server.url, FMT) as writer:
        for depth, name in enumerate(["a", "b", "c"]):
            assert writer.submit_write(digest(name), depth, lambda name=name: body(name), KEY)
        assert writer.flush(5)
        assert writer.stats.writes == 3
    with open_tier(server.url, FMT) as reader:
        got = reader.fetch([digest("a"), digest("b"), digest("c"), digest("d")], KEY)
        assert [bytes(p) for p in got] == [body("a"), body("b"), body("c")]
        stats = reader.stats
        assert (stats.hit_blocks, stats.miss_blocks, stats.loads) == (3, 1, 1)
        assert stats.bytes_read == 3 * len(value("a"))


def test_killed_server_breaker_opens_then_closes_after_restart():
    clock = FakeClock()
    with redis_server() as server:
        client = TierClient(RedisTier(server.url), FMT, failure_threshold=3, clock=clock)
        client.submit_write(digest("a"), 0, body("a"), KEY)
        assert client.flush(5) and len(client.fetch([digest("a")], KEY)) == 1
        server.kill()
        for _ in range(3):
            assert client.fetch([digest("a")], KEY) == []  # never raises
        assert client.breaker_state == "open" and client.breaker_opens == 1
        assert client.stats.errors == 3
        started = time.perf_counter()
        assert client.fetch([digest("a")], KEY) == []
        assert time.perf_counter() - started < 0.05  # open: no call to the dead server
        assert client.stats.errors == 3
        assert not client.submit_write(digest("b"), 0, body("b"), KEY)
        assert client.stats.writes_dropped == 1
        clock.now += 1.0
        assert client.breaker_state == "half_open"
        assert client.fetch([digest("a")], KEY) == []  # the probe fails: open, cooldown doubled
        clock.now += 1.0
        assert client.breaker_state == "open" and client.stats.errors == 4
        server.restart()  # empty: nothing is persisted
        clock.now += 1.0
        assert client.fetch([digest("a")], KEY) == []  # the probe succeeds: a plain miss
        assert client.breaker_state == "closed" and client.breaker_opens == 1
        assert client.submit_write(digest("a"), 0, body("a"), KEY) and client.flush(5)
        assert [bytes(p) for p in client.fetch([digest("a")], KEY)] == [body("a")]
        client.close()


def test_paused_server_times_out_quickly():
    with redis_server() as server:
        client = TierClient(RedisTier(server.url, socket_timeout=0.2), FMT)
        client.submit_write(digest("a"), 0, body("a"), KEY)
        assert client.flush(5)
        server.pause()
        try:
            started = time.perf_counter()
            assert client.fetch([digest("a")], KEY) == []
            assert time.perf_counter() - started < 1.0
            assert client.stats.errors == 1
        finally:
            server.resume()
        client.close()


def test_password_and_database_from_the_url():
    with redis_server(password="s3cret") as server:
        url = f"redis://:s3cret@127.0.0.1:{server.port}/2"
        with open_tier(url, FMT) as client:
            assert client.submit_write(digest("a"), 0, body("a"), KEY) and client.flush(5)
            assert client.stats.writes == 1
        with server.client(db=2) as plain:
            assert plain.dbsize() == 1
        with open_tier(f"redis://:wrong@127.0.0.1:{server.port}/2", FMT) as client:
            assert client.fetch([digest("a")], KEY) == []
            assert client.stats.errors == 1


def test_errors_are_tier_errors():
    with redis_server() as server:
        tier = RedisTier(server.url)
        server.kill()
        with pytest.raises(TierError, match="redis tier present"):
            tier.present([digest("a")])
        with pytest.raises(TierError):
            tier.put(digest("a"), value("a"), 0)
        tier.close()


def test_full_server_refuses_writes_without_errors():
    args = ["--maxmemory", "3mb", "--maxmemory-policy", "noeviction"]
    with redis_server(extra_args=args) as server:
        tier = RedisTier(server.url)
        big = b"x" * 200_000
        results = [tier.put(digest(f"b{i}"), big, 0) for i in range(40)]
        assert results[0] and not results[-1]  # no TierError: a full store is a no-write
        tier.close()


def test_three_node_cluster_round_trip():
    with redis_cluster(3) as cluster:
        names = [f"c{i}" for i in range(40)]
        spec = cluster.url.replace("redis://", "redis+cluster://").removesuffix("/0")
        with open_tier(spec, FMT, ttl_seconds=600) as writer:  # the even ones retained a day
            for depth, name in enumerate(names):
                ttl = 86400.0 if depth % 2 == 0 else None
                assert writer.submit_write(digest(name), depth, body(name), KEY, ttl)
            assert writer.flush(10) and writer.stats.writes == 40
        with open_tier(spec, FMT, ttl_seconds=600) as reader:  # the READ script, per node
            got = reader.fetch([digest(n) for n in names], KEY)
            assert [bytes(p) for p in got] == [body(n) for n in names]
            assert reader.stats.errors == 0
        sizes, retained = [], 0
        for node in cluster.nodes:
            with node.client() as client:
                sizes.append(client.dbsize())
                ttls = [client.ttl(key) for key in client.keys("*")]
                assert all(86000 <= t <= 86400 or 590 <= t <= 600 for t in ttls), ttls
                retained += sum(t > 600 for t in ttls)
        assert sum(sizes) == 40 and all(sizes)  # one key per block, spread over the nodes
        assert retained == 20
