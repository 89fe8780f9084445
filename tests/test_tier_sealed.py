"""Sealed tier values against a forger on the store: a real redis-server and a real folder.

Whoever can write the store may rewrite, move or swap values; whoever can read it sees
only noise. Every such value is a miss (counted, removed), and the answer is cache-off's.
"""

from __future__ import annotations

import os
from array import array
from pathlib import Path

import pytest

from engine_fixtures import TEST_TIER_KEYS, tiny_engine
from prefixcache.tier.codec import read_header
from prefixcache.tier.redis_tier import RedisTier
from prefixcache.tier.seal import TAG_BYTES, TierKeys
from redis_fixtures import redis_server
from test_tier_engine import DOCUMENT, GREEDY, finish, reference

SALT, OTHER_SALT = "tenant-a", "tenant-b"
REDIS_PREFIX = RedisTier.__init__.__kwdefaults__["key_prefix"]


@pytest.fixture(scope="module")
def redis():
    with redis_server() as server:
        yield server


def ask(engine, prompt: list[int], salt: str = SALT, previous: str | None = None):
    """One greedy request with a tenant's salt, after the last one's writes landed."""
    engine.add_request("q", prompt, GREEDY, cache_salt=salt, previous_cache_salt=previous)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                final = output
    assert engine.tier.client.flush(timeout=10)
    return final


def stored(redis) -> dict[bytes, bytes]:
    """Every block value in Redis, by its Redis key."""
    client = redis.client()
    return {key: client.get(key) for key in client.keys(REDIS_PREFIX + b"*")}


def filled(redis, keys: TierKeys = TEST_TIER_KEYS) -> int:
    """A replica stored the document's blocks under tenant A's salt; how many values."""
    redis.client().flushall()
    writer = tiny_engine(kv_tier=redis.url, tier_keys=keys)
    ask(writer, DOCUMENT)
    finish(writer)
    writer.close()
    count = len(stored(redis))
    assert count >= 10  # the prompt's 10 full blocks (and what decoding filled)
    return count


def fresh_answer(redis, **options):
    """A fresh replica's answer to the document, and its tier's rejections."""
    engine = tiny_engine(kv_tier=redis.url, **options)
    output = ask(engine, DOCUMENT)
    rejected = engine.tier.client.stats.rejected
    finish(engine)
    engine.close()
    return output, rejected


def test_an_untouched_value_is_a_tier_hit_across_replicas(redis):
    filled(redis)
    output, rejected = fresh_answer(redis)
    assert output.num_tier_tokens == 40 and rejected == {}
    assert output.token_ids == reference([DOCUMENT])[0]


def test_a_rewritten_payload_is_a_forgery_removed_and_the_answer_is_cache_off(redis):
    count = filled(redis)
    client = redis.client()
    for key, value in stored(redis).items():  # header untouched, another payload of the size
        start = read_header(value).header_len
        client.set(key, value[:start] + os.urandom(len(value) - start))
    output, rejected = fresh_answer(redis)
    assert output.num_tier_tokens == 0 and rejected == {"forged": 1}
    assert output.token_ids == reference([DOCUMENT])[0]
    assert len(stored(redis)) == count  # the forged first block was removed, written again
    again, rejected = fresh_answer(redis)  # block 0 is sound again; block 1 is the next forgery
    assert again.num_tier_tokens == 4 and rejected == {"forged": 1}


def test_a_value_moved_to_another_digest_is_a_miss(redis):
    filled(redis)
    client = redis.client()
    values = stored(redis)
    first, second = sorted(values, key=lambda key: read_header(values[key]).depth)[:2]
    client.set(first, values[second])  # block 1's sealed value under block 0's key
    output, rejected = fresh_answer(redis)
    assert output.num_tier_tokens == 0 and rejected == {"digest": 1}
    assert output.token_ids == reference([DOCUMENT])[0]


def test_a_replica_with_another_secret_or_tenant_reads_nothing_and_still_serves(redis):
    filled(redis)
    other, rejected = fresh_answer(redis, tier_keys=TierKeys(os.urandom(32)))
    assert other.num_tier_tokens == 0 and rejected == {"key": 1}
    assert other.token_ids == reference([DOCUMENT])[0]
    filled(redis)
    engine = tiny_engine(kv_tier=redis.url)
    output = ask(engine, DOCUMENT, salt=OTHER_SALT)  # another tenant: other digests entirely
    assert output.num_tier_tokens == 0 and engine.tier.client.stats.rejected == {}
    engine.close()


def test_during_a_rotation_the_previous_secret_still_reads(redis):
    old, new = os.urandom(32), os.urandom(32)
    filled(redis, TierKeys(old))  # written under the old secret, with the old salt
    rotating = tiny_engine(kv_tier=redis.url, tier_keys=TierKeys(new, old))
    output = ask(rotating, DOCUMENT, salt="new-salt", previous="tenant-a")
    assert output.num_tier_tokens == 40
    assert output.token_ids == reference([DOCUMENT])[0]
    finish(rotating)
    rotating.close()
    after = tiny_engine(kv_tier=redis.url, tier_keys=TierKeys(new))  # window over
    late = ask(after, DOCUMENT, salt="new-salt", previous="tenant-a")
    assert late.num_tier_tokens == 0  # no previous secret: the old values are not read
    after.close()


def test_no_stored_value_looks_like_kv(redis):
    filled(redis)
    engine = tiny_engine(kv_tier=redis.url)
    ask(engine, DOCUMENT)
    seq_blocks = [block.block_id for block in engine.manager.pool.blocks if block.digest]
    plain = [bytes(copy.numpy().tobytes()) for copy in engine.kv_store.read_blocks(seq_blocks)]
    engine.close()
    doubles = array("d")  # every sealed payload, read as the engine's dtype (float64)
    for value in stored(redis).values():
        sealed = value[read_header(value).header_len : -TAG_BYTES]
        assert not any(kv[:64] in value for kv in plain)  # no plain K/V run inside
        doubles.extend(array("d", sealed[: len(sealed) // 8 * 8]))
    # K/V are small numbers (all of them below 100); random bits are below 100 about half
    # the time (the exponent), so over all values together (thousands of doubles: a spread
    # of about 0.01) the share sits near 0.5, far from both 0.6 and the plain K/V's 1.0
    assert len(doubles) > 1000
    plausible = sum(1 for x in doubles if abs(x) < 100.0) / len(doubles)
    assert plausible < 0.6, plausible
    assert all(abs(x) < 100.0 for copy in plain for x in array("d", copy))  # the contrast


def test_the_disk_tier_refuses_edited_and_swapped_files(tmp_path: Path):
    spec = f"disk:{tmp_path / 'tier'}"
    writer = tiny_engine(kv_tier=spec)
    ask(writer, DOCUMENT)
    finish(writer)
    writer.close()
    files = sorted((tmp_path / "tier").glob("??/*.kvb"), key=lambda p: read_header(
        p.read_bytes()).depth)  # fmt: skip
    edited = bytearray(files[0].read_bytes())
    edited[-TAG_BYTES - 1] ^= 0x01
    files[0].write_bytes(bytes(edited))
    output, rejected = fresh_disk(spec)
    assert output.num_tier_tokens == 0 and rejected == {"forged": 1}
    second, third = files[1].read_bytes(), files[2].read_bytes()
    files[1].write_bytes(third)  # two sealed blocks swapped on disk
    files[2].write_bytes(second)
    output, rejected = fresh_disk(spec)
    # block 0 was written again; the folder's scan refuses the swapped files by name
    assert output.num_tier_tokens == 4 and rejected == {"bad_header": 2}
    assert output.token_ids == reference([DOCUMENT])[0]


def fresh_disk(spec: str):
    engine = tiny_engine(kv_tier=spec)
    output = ask(engine, DOCUMENT)
    stats = engine.tier.client.stats
    engine.close()
    return output, {**stats.rejected, **stats.rejected_files}


def test_an_engine_without_keys_keeps_its_disk_tier_secret_beside_it(tmp_path: Path):
    spec = f"disk:{tmp_path / 'tier'}"
    first = tiny_engine(kv_tier=spec, tier_keys=None)
    ask(first, DOCUMENT)
    finish(first)
    first.close()
    secret = tmp_path / "tier" / "tenant-secret"
    assert secret.stat().st_mode & 0o777 == 0o600
    again = tiny_engine(kv_tier=spec, tier_keys=None)  # a restart: the same secret, warm
    assert ask(again, DOCUMENT).num_tier_tokens == 40
    again.close()
