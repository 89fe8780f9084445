"""The engine over a second KV tier: same tokens, blocks that outlive the pool and the process."""

from __future__ import annotations

import random
from functools import cache
from pathlib import Path

import pytest

from engine_fixtures import assert_pool_clean, serve_in_turn, tiny_engine
from prefixcache.engine.sampling import SamplingParams
from redis_fixtures import redis_server

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
DOCUMENT = list(range(1000, 1041))  # 41 tokens: 10 full blocks of 4 are reusable


def workload(seed: int, count: int = 14) -> list[list[int]]:
    """Prompts that share a few documents and differ in their questions."""
    rng = random.Random(seed)
    documents = [[rng.randrange(200, 5000) for _ in range(rng.randrange(16, 40))] for _ in range(4)]
    return [
        rng.choice(documents) + [rng.randrange(200, 5000) for _ in range(rng.randrange(1, 9))]
        for _ in range(count)
    ]


def serve(engine, prompts: list[list[int]], prefix: str = "r") -> list:
    return serve_in_turn(engine, prompts, GREEDY, prefix)


def tokens(outputs: list) -> list[list[int]]:
    return [output.token_ids for output in outputs]


def reference(prompts: list[list[int]]) -> list[list[int]]:
    """The tokens without cache or tier; once per prompt list (every test's tiny model is the
    same, so the disk and redis cases of a seed share it)."""
    return [list(output) for output in _reference(tuple(map(tuple, prompts)))]


@cache
def _reference(prompts: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
    engine = tiny_engine(enable_prefix_caching=False)
    return tuple(map(tuple, tokens(serve(engine, [list(prompt) for prompt in prompts]))))


def finish(engine) -> None:
    """Every block back in the pool, the invariants hold, queued writes are done."""
    assert_pool_clean(engine)
    assert engine.tier.client.flush(timeout=10)


@pytest.fixture(scope="module")
def redis():
    with redis_server() as server:
        yield server


def tier_specs(tmp_path: Path, redis) -> dict[str, str]:
    return {"disk": f"disk:{tmp_path / 'tier'}", "redis": redis.url}


@pytest.mark.parametrize("backend", ["disk", "redis"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_greedy_tokens_equal_with_the_tier_on_and_off(tmp_path, redis, backend, seed):
    redis.client().flushall()
    prompts = workload(seed)
    engine = tiny_engine(num_kv_blocks=14, kv_tier=tier_specs(tmp_path, redis)[backend])
    outputs = serve(engine, prompts)
    finish(engine)
    assert tokens(outputs) == reference(prompts)
    assert sum(output.num_tier_tokens for output in outputs) > 0  # the pool was too small
    assert engine.manager.stats.tier_hits == sum(o.num_tier_tokens for o in outputs)
    engine.close()


def test_a_restart_serves_its_first_request_from_the_disk_tier(tmp_path):
    spec = f"disk:{tmp_path / 'tier'}"
    first = tiny_engine(kv_tier=spec)
    (before,) = serve(first, [DOCUMENT])
    finish(first)
    first.close()
    second = tiny_engine(kv_tier=spec)
    (after,) = serve(second, [DOCUMENT])
    assert after.num_cached_tokens == after.num_tier_tokens == 40
    assert after.token_ids == before.token_ids == reference([DOCUMENT])[0]
    finish(second)
    second.close()


def test_a_second_engine_serves_what_only_the_first_computed(redis):
    redis.client().flushall()
    first, second = tiny_engine(kv_tier=redis.url), tiny_engine(kv_tier=redis.url)
    serve(first, [DOCUMENT])
    finish(first)
    (shared,) = serve(second, [DOCUMENT + [7, 8]])
    assert shared.num_tier_tokens == 40
    assert shared.token_ids == reference([DOCUMENT + [7, 8]])[0]
    finish(second)
    for engine in (first, second):
        engine.close()


def test_a_corrupted_or_torn_block_file_is_a_miss_and_recomputed(tmp_path):
    spec = f"disk:{tmp_path / 'tier'}"
    first = tiny_engine(kv_tier=spec)
    serve(first, [DOCUMENT])
    finish(first)
    first.close()
    files = sorted((tmp_path / "tier").glob("*/*.kvb"))
    assert len(files) == 11  # 41 prompt + 6 generated tokens: 11 full blocks of 4
    for path in files[:3]:  # flip one byte in three blocks, cut three more short
        data = bytearray(path.read_bytes())
        data[-7] ^= 0xFF
        path.write_bytes(bytes(data))
    for path in files[3:6]:
        path.write_bytes(path.read_bytes()[:100])
    second = tiny_engine(kv_tier=spec)
    (after,) = serve(second, [DOCUMENT])
    assert after.token_ids == reference([DOCUMENT])[0]
    rejected = second.tier.client.stats.rejected
    assert sum(rejected.values()) >= 1  # the first damaged block on the path ends the run
    assert after.num_tier_tokens < 40
    finish(second)
    second.close()


def test_other_dtype_shares_no_blocks(tmp_path):
    spec = f"disk:{tmp_path / 'tier'}"
    wide = tiny_engine(kv_tier=spec)
    serve(wide, [DOCUMENT])
    finish(wide)
    wide.close()
    import torch

    narrow = tiny_engine(kv_tier=spec, dtype=torch.float32)  # another namespace: other digests
    (after,) = serve(narrow, [DOCUMENT])
    assert after.num_tier_tokens == 0
    finish(narrow)
    narrow.close()


def test_redis_killed_mid_load_fails_no_request_and_is_used_again(redis):
    redis.client().flushall()
    prompts = workload(7, count=10)
    engine = tiny_engine(num_kv_blocks=14, kv_tier=redis.url)
    engine.tier.client.breaker.cooldown_seconds = 0.05
    expected = reference(prompts)
    assert tokens(serve(engine, prompts[:4], "a")) == expected[:4]
    redis.kill()
    assert tokens(serve(engine, prompts[4:], "b")) == expected[4:]  # from the pool alone
    assert_pool_clean(engine)
    assert engine.tier.client.stats.errors > 0
    redis.restart()
    engine.tier.client.breaker.opened_at = -1.0  # cooldown over: the next call probes
    serve(engine, [DOCUMENT], "c")
    finish(engine)
    (again,) = serve(tiny_engine(kv_tier=redis.url), [DOCUMENT], "d")
    assert again.num_tier_tokens == 40  # written after the restart, read by a new engine
    engine.close()


def test_a_stalled_store_costs_at_most_the_deadline(redis):
    redis.client().flushall()
    writer = tiny_engine(kv_tier=redis.url)
    serve(writer, [DOCUMENT])
    finish(writer)
    engine = tiny_engine(kv_tier=redis.url, kv_tier_max_wait=0.01)
    redis.pause()
    try:
        (output,) = serve(engine, [DOCUMENT])
    finally:
        redis.resume()
    assert output.num_tier_tokens == 0 and engine.tier.timeouts == 1
    assert output.token_ids == reference([DOCUMENT])[0]
    assert_pool_clean(engine)
    for each in (writer, engine):
        each.close()


def test_a_three_node_redis_cluster_serves_a_tier_hit():
    from redis_fixtures import redis_cluster

    with redis_cluster(3) as cluster:
        spec = cluster.url.replace("redis://", "redis+cluster://")
        first, second = tiny_engine(kv_tier=spec), tiny_engine(kv_tier=spec)
        serve(first, [DOCUMENT])
        (shared,) = serve(second, [DOCUMENT])
        assert shared.num_tier_tokens == 40
        assert shared.token_ids == reference([DOCUMENT])[0]
        finish(second)
        for engine in (first, second):
            engine.close()


def test_tier_stores_and_evictions_are_events_with_their_medium(tmp_path):
    from prefixcache.cache.events import BlockRemoved, BlockStored

    events = []
    block_bytes = 2 * 2 * 4 * 2 * 8 * 8 + 256  # 2 layers of K and V in float64, a header
    engine = tiny_engine(kv_tier=f"disk:{tmp_path / 'tier'}", kv_tier_max_bytes=6 * block_bytes)
    engine.set_event_sink(events.append)
    serve(engine, [DOCUMENT])
    finish(engine)
    stored = [e for e in events if isinstance(e, BlockStored) and e.medium == "disk"]
    removed = [e for e in events if isinstance(e, BlockRemoved) and e.medium == "disk"]
    assert len(stored) == engine.tier.client.stats.writes == 11
    assert sum(len(e.block_hashes) for e in removed) == engine.tier.client.stats.evictions > 0
    assert all(e.token_ids == [] for e in stored)
    engine.close()
