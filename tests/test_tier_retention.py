"""Retention in the second tier: retained blocks keep their TTL in Redis and their place on disk.

Real redis-server processes (``redis_fixtures``) and real folders under tmp_path; the engine
cases run the tiny model with ``Keep`` marks and end with the Redis key's own TTL.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from clock_fixtures import FakeClock
from engine_fixtures import assert_pool_clean, run_to_completion, tiny_engine
from prefixcache.cache.retention import Keep
from prefixcache.engine.sampling import SamplingParams
from prefixcache.tier import DiskTier, RedisTier, TierClient
from redis_fixtures import RedisProcess, redis_server
from test_tier_disk import FMT, KEY, SIZE, block_file, digest, value

DAY = 86400.0
TIER_TTL = 600
GREEDY = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
WALL_NOW = 1_800_000_000.0  # the disk tier's clock is wall-clock seconds (moved by hand)


@pytest.fixture(scope="module")
def shared_server() -> Iterator[RedisProcess]:
    with redis_server() as server:
        yield server


@pytest.fixture
def server(shared_server: RedisProcess) -> RedisProcess:
    with shared_server.client() as client:
        client.flushall()
    return shared_server


def ttl(server: RedisProcess, tier: RedisTier, name: str) -> int:
    with server.client() as client:
        return client.ttl(tier.key(digest(name)))


# -- Redis ----------------------------------------------------------------------------------


def test_a_retained_block_is_written_with_its_ttl_and_others_with_the_tiers(server):
    tier = RedisTier(server.url, ttl_seconds=TIER_TTL)
    assert tier.put(digest("day"), value("day"), 0, DAY)
    assert tier.put(digest("short"), value("short"), 0, 30.0)  # shorter than the tier's own
    assert tier.put(digest("plain"), value("plain"), 0)
    assert 86000 <= ttl(server, tier, "day") <= 86400
    assert TIER_TTL - 5 <= ttl(server, tier, "short") <= TIER_TTL
    assert TIER_TTL - 5 <= ttl(server, tier, "plain") <= TIER_TTL
    tier.close()


def test_a_read_never_shortens_a_retained_ttl_and_still_refreshes_the_rest(server):
    tier = RedisTier(server.url, ttl_seconds=TIER_TTL)
    tier.put(digest("day"), value("day"), 0, DAY)
    tier.put(digest("plain"), value("plain", 1), 1)
    with server.client() as client:
        client.expire(tier.key(digest("plain")), 5)
    assert tier.get([digest("day"), digest("plain")]) == [value("day"), value("plain", 1)]
    assert 86000 <= ttl(server, tier, "day") <= 86400
    assert TIER_TTL - 5 <= ttl(server, tier, "plain") <= TIER_TTL
    tier.close()


def test_retaining_a_stored_block_lengthens_its_ttl_and_never_shortens_it(server):
    tier = RedisTier(server.url, ttl_seconds=TIER_TTL)
    tier.put(digest("hit"), value("hit"), 0)
    assert ttl(server, tier, "hit") <= TIER_TTL
    assert tier.retain(digest("hit"), DAY)
    assert 86000 <= ttl(server, tier, "hit") <= 86400
    assert tier.retain(digest("hit"), 3600.0)  # a shorter mark
    assert 86000 <= ttl(server, tier, "hit") <= 86400
    assert not tier.put(digest("hit"), value("hit"), 0)  # NX: the first copy stays
    assert not tier.retain(digest("absent"), DAY)
    with server.client() as client:
        assert client.exists(tier.key(digest("absent"))) == 0  # nothing made
    tier.close()


def test_a_second_write_of_a_stored_block_with_a_ttl_lengthens_it(server):
    writer = RedisTier(server.url, ttl_seconds=TIER_TTL)
    writer.put(digest("shared"), value("shared"), 0)  # another replica wrote it unretained
    client = TierClient(RedisTier(server.url, ttl_seconds=TIER_TTL), FMT)
    body = bytes(4 * 32 * 4)
    assert client.submit_write(digest("shared"), 0, body, KEY, ttl_seconds=DAY)
    assert client.flush(5) and client.stats.writes == 0  # present: no payload moved
    assert 86000 <= ttl(server, writer, "shared") <= 86400
    client.close()
    writer.close()


def test_without_a_tier_ttl_a_retained_block_never_expires(server):
    tier = RedisTier(server.url)
    tier.put(digest("day"), value("day"), 0, DAY)
    assert tier.retain(digest("day"), DAY)
    assert ttl(server, tier, "day") == -1  # no expiry: longer than any mark
    tier.close()


# -- disk -----------------------------------------------------------------------------------


def record_file(root: Path, name: str) -> Path:
    return block_file(root, name).with_suffix(".ret")


def test_the_cap_evicts_unretained_blocks_first_and_keeps_a_retained_one(tmp_path: Path):
    removed: list[bytes] = []
    tier = DiskTier(tmp_path, 3 * SIZE, on_removed=removed.extend, clock=FakeClock(WALL_NOW))
    assert tier.put(digest("kept"), value("kept", 9), 9, DAY)  # deepest and oldest
    for name, depth in [("a", 0), ("b", 1), ("c", 0), ("d", 2)]:
        assert tier.put(digest(name), value(name, depth), depth)
    assert removed == [digest("b"), digest("a")]  # deepest-then-oldest among the unretained
    assert tier.present([digest("kept")]) == 1
    tier.close()


def test_retained_blocks_go_only_when_nothing_else_is_left_earliest_expiry_first(tmp_path):
    removed: list[bytes] = []
    tier = DiskTier(tmp_path, 2 * SIZE, on_removed=removed.extend, clock=FakeClock(WALL_NOW))
    tier.put(digest("day"), value("day"), 0, DAY)
    tier.put(digest("hour"), value("hour", 3), 3, 3600.0)
    tier.put(digest("new"), value("new"), 0)
    assert removed == [digest("hour")]
    tier.put(digest("newer"), value("newer"), 0)
    assert removed == [digest("hour"), digest("new")]  # an unretained one before "day"
    assert tier.present([digest("day")]) == 1
    tier.close()


def test_a_restart_keeps_the_expiry(tmp_path: Path):
    clock = FakeClock(WALL_NOW)
    first = DiskTier(tmp_path, 3 * SIZE, clock=clock)
    first.put(digest("kept"), value("kept", 5), 5, DAY)
    first.put(digest("plain"), value("plain"), 0)
    first.put(digest("later"), value("later"), 0)
    assert first.retain(digest("later"), 2 * DAY)  # a block retained after it was stored
    first.close()
    assert record_file(tmp_path, "kept").stat().st_mode & 0o777 == 0o600
    removed: list[bytes] = []
    again = DiskTier(tmp_path, 3 * SIZE, on_removed=removed.extend, clock=clock)
    assert again.retained_until(digest("kept")) == clock.now + DAY
    assert again.retained_until(digest("later")) == clock.now + 2 * DAY
    assert again.retained_until(digest("plain")) is None
    again.put(digest("x"), value("x", 7), 7)
    again.put(digest("y"), value("y", 7), 7)
    assert removed == [digest("plain"), digest("x")]
    assert again.present([digest("kept"), digest("later")]) == 2
    again.close()


def test_an_expired_mark_is_an_ordinary_block_again(tmp_path: Path):
    clock = FakeClock(WALL_NOW)
    removed: list[bytes] = []
    tier = DiskTier(tmp_path, 3 * SIZE, on_removed=removed.extend, clock=clock)
    tier.put(digest("old"), value("old"), 0)
    tier.put(digest("marked"), value("marked", 4), 4, 60.0)
    tier.put(digest("mid"), value("mid", 1), 1)
    clock.now += 61
    assert tier.retained_until(digest("marked")) is None
    assert tier.get([digest("marked")]) == [value("marked", 4)]  # not deleted for expiring
    tier.put(digest("new"), value("new"), 0)
    assert removed == [digest("marked")]  # the deepest, as any block
    tier.close()
    tier = DiskTier(tmp_path, 3 * SIZE, clock=clock)
    tier.put(digest("held"), value("held", 2), 2, 60.0)
    tier.close()
    clock.now += 61
    removed.clear()
    again = DiskTier(tmp_path, 3 * SIZE, on_removed=removed.extend, clock=clock)
    assert again.retained_until(digest("held")) is None
    assert not record_file(tmp_path, "held").exists()  # an expired record goes at start
    again.put(digest("z"), value("z"), 0)
    assert removed == [digest("held")]  # deepest first again
    again.close()


# -- the engine -----------------------------------------------------------------------------

PROMPT = list(range(300, 321))  # 21 tokens: 5 full blocks of 4


def prompt_keys(engine, tokens: list[int]) -> list[bytes]:
    backend = engine.tier.client.backend
    return [backend.key(d) for d in engine.manager.prompt_digests(tokens, None)]


def run(engine, request_id: str, tokens: list[int], retention=()):
    engine.add_request(request_id, tokens, GREEDY, retention=retention)
    output = run_to_completion(engine)[request_id]
    assert engine.tier.client.flush(10)
    return output


@pytest.mark.parametrize("batched", [64, 8], ids=["one-chunk", "chunked"])
def test_the_engine_writes_a_24h_retained_prefix_with_a_24h_ttl(server, batched: int):
    engine = tiny_engine(
        kv_tier=server.url, kv_tier_ttl_seconds=TIER_TTL, max_num_batched_tokens=batched
    )
    run(engine, "keep", PROMPT, retention=(Keep(12, DAY, "24h"),))
    keys = prompt_keys(engine, PROMPT)
    with server.client() as client:
        ttls = [client.ttl(key) for key in keys[:5]]
    assert all(86000 <= left <= 86400 for left in ttls[:3]), ttls
    assert all(TIER_TTL - 10 <= left <= TIER_TTL for left in ttls[3:]), ttls
    assert_pool_clean(engine)
    engine.close()


def test_a_retained_hit_lengthens_the_ttl_of_blocks_already_in_redis(server):
    first = tiny_engine(kv_tier=server.url, kv_tier_ttl_seconds=TIER_TTL)
    run(first, "plain", PROMPT)  # computed, stored with the tier's TTL
    keys = prompt_keys(first, PROMPT)
    with server.client() as client:
        assert all(client.ttl(key) <= TIER_TTL for key in keys[:5])
    hit = run(first, "pool-hit", PROMPT + [6], retention=(Keep(8, DAY, "24h"),))
    assert hit.num_cached_tokens == 20 and hit.num_tier_tokens == 0  # from the pool
    with server.client() as client:
        ttls = [client.ttl(key) for key in keys[:5]]
    assert all(86000 <= left <= 86400 for left in ttls[:2]), ttls
    assert all(left <= TIER_TTL for left in ttls[2:]), ttls
    second = tiny_engine(kv_tier=server.url, kv_tier_ttl_seconds=TIER_TTL)
    loaded = run(second, "tier-hit", PROMPT + [5], retention=(Keep(16, DAY, "24h"),))
    assert loaded.num_tier_tokens == 20  # its blocks came from Redis, not computed
    with server.client() as client:
        ttls = [client.ttl(key) for key in keys[:5]]
    assert all(86000 <= left <= 86400 for left in ttls[:4]), ttls
    assert ttls[4] <= TIER_TTL
    for engine in (first, second):
        assert_pool_clean(engine)
        engine.close()


def test_the_engine_retains_blocks_in_the_disk_tier(tmp_path: Path):
    engine = tiny_engine(kv_tier=f"disk:{tmp_path / 'tier'}")
    run(engine, "keep", PROMPT, retention=(Keep(8, DAY, "24h"),))
    backend = engine.tier.client.backend
    digests = engine.manager.prompt_digests(PROMPT, None)
    until = [backend.retained_until(d) for d in digests[:3]]
    assert until[0] is not None and until[1] is not None and until[2] is None
    assert_pool_clean(engine)
    engine.close()
