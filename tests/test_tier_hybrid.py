"""A hybrid pool over a second KV tier: each window group's pages are their own values, and
a load takes the full layers of every block and the window groups' window before its end.

The tiny Gemma 3 (``tiny_gemma_model``): blocks of 4 tokens, two window groups of 8 tokens
(a load's end needs each group's last 2 blocks), one full group. Tokens are checked against
the same model without cache or tier (float64: batching cannot flip a greedy choice).
"""

from __future__ import annotations

from functools import cache

from hypothesis import given
from hypothesis import strategies as st

from engine_fixtures import (
    assert_pool_clean,
    serve_in_turn,
    tiny_engine,
    tiny_gemma_model,
)
from prefixcache.cache.events import BlockStored
from prefixcache.engine.sampling import SamplingParams
from prefixcache.engine.tier_link import Fetched, usable_end
from redis_fixtures import redis_server

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
DOCUMENT = list(range(1000, 1041))  # 41 tokens: 10 full blocks of 4 are reusable
WINDOW_BLOCKS = 2  # blocks of 4 before a hit's end that a window of 8 reads


def gemma_engine(**options: object):
    return tiny_engine(tiny_gemma_model(), **options)


def serve(engine, prompts: list[list[int]], prefix: str = "r") -> list:
    return serve_in_turn(engine, prompts, GREEDY, prefix)


@cache
def reference(prompt: tuple[int, ...]) -> list[int]:
    """Greedy tokens without cache or tier."""
    engine = gemma_engine(enable_prefix_caching=False)
    return serve(engine, [list(prompt)])[0].token_ids


def finish(engine) -> None:
    assert_pool_clean(engine)
    assert engine.tier.client.flush(timeout=10)
    engine.close()


def test_a_restart_loads_the_full_layers_and_only_the_window_before_the_end(tmp_path):
    spec = f"disk:{tmp_path / 'tier'}"
    first = gemma_engine(kv_tier=spec)
    assert first.layout.pages_per_block == 3  # 1 full + 2 window groups
    (before,) = serve(first, [DOCUMENT])
    writes = first.tier.client.stats.writes
    finish(first)
    assert writes == 11 * 3  # 41 prompt + 6 generated tokens: 11 full blocks, 3 pages each
    second = gemma_engine(kv_tier=spec)
    (after,) = serve(second, [DOCUMENT + [7, 8, 9]])
    assert after.num_cached_tokens == after.num_tier_tokens == 40
    assert after.token_ids == reference(tuple(DOCUMENT + [7, 8, 9]))
    assert before.token_ids == reference(tuple(DOCUMENT))
    stats = second.tier.client.stats
    assert stats.hit_blocks == 10 + 2 * WINDOW_BLOCKS  # never a window page it does not read
    windows = second.manager.windows
    assert windows is not None and windows.counts[0] >= WINDOW_BLOCKS
    finish(second)


def test_a_shared_prefix_loads_from_mid_prompt_windows(tmp_path):
    """Two prompts share 20 tokens: the second loads 5 blocks, its windows from the middle
    of the first prompt (whose window pages the first engine stored too)."""
    spec = f"disk:{tmp_path / 'tier'}"
    first = gemma_engine(kv_tier=spec)
    serve(first, [DOCUMENT])
    finish(first)
    second = gemma_engine(kv_tier=spec)
    other = DOCUMENT[:20] + list(range(3000, 3015))
    (after,) = serve(second, [other])
    assert after.num_tier_tokens == 20
    assert after.token_ids == reference(tuple(other))
    finish(second)


def test_a_missing_window_value_cuts_the_load_to_what_every_group_serves(tmp_path):
    """Deleting one window group's value of the last loadable block: no end past it is
    served by that group's window, so nothing loads; the tokens are still right."""
    spec = f"disk:{tmp_path / 'tier'}"
    first = gemma_engine(kv_tier=spec)
    serve(first, [DOCUMENT])
    digests = first.manager.prompt_digests(DOCUMENT)
    (missing,) = first.manager.group_digests(digests[-1:], 2)
    finish(first)
    files = [p for p in (tmp_path / "tier").rglob("*.kvb") if missing.hex() in p.name]
    assert len(files) == 1
    files[0].unlink()
    second = gemma_engine(kv_tier=spec)
    (after,) = serve(second, [DOCUMENT])
    assert after.num_tier_tokens == 0
    assert after.token_ids == reference(tuple(DOCUMENT))
    finish(second)


def test_a_pool_hit_shorter_than_the_load_keeps_its_windows(tmp_path):
    """The pool holds the first 5 blocks (a prompt of 21 tokens); the tier holds 10: the load
    adds blocks 5..9, its windows from the tier, and the pool's own hit stays."""
    spec = f"disk:{tmp_path / 'tier'}"
    first = gemma_engine(kv_tier=spec)
    serve(first, [DOCUMENT])
    finish(first)
    second = gemma_engine(kv_tier=spec)
    serve(second, [DOCUMENT[:21]], prefix="short")  # loads 5 blocks from the tier
    (after,) = serve(second, [DOCUMENT])
    assert after.num_cached_tokens == 40
    assert after.num_tier_tokens == 20  # 5 from the pool, 5 from the tier
    assert after.token_ids == reference(tuple(DOCUMENT))
    finish(second)


def test_hybrid_and_full_replicas_share_no_tier_values(tmp_path):
    """Their pages hold different layers: a value of one layout never loads into the other
    (different namespaces: not even looked up as the same block)."""
    spec = f"disk:{tmp_path / 'tier'}"
    hybrid = gemma_engine(kv_tier=spec)
    serve(hybrid, [DOCUMENT])
    finish(hybrid)
    full = gemma_engine(kv_tier=spec, kv_layout="full")
    assert full.manager.root_digest != hybrid.manager.root_digest
    (after,) = serve(full, [DOCUMENT])
    assert after.num_tier_tokens == 0
    assert after.token_ids == reference(tuple(DOCUMENT))
    assert not full.tier.client.stats.rejected  # nothing read under a wrong shape
    finish(full)


def test_a_redis_tier_serves_a_second_replica(tmp_path):
    with redis_server() as redis:
        first, second = gemma_engine(kv_tier=redis.url), gemma_engine(kv_tier=redis.url)
        serve(first, [DOCUMENT])
        (shared,) = serve(second, [DOCUMENT + [7, 8]])
        assert shared.num_tier_tokens == 40
        assert shared.token_ids == reference(tuple(DOCUMENT + [7, 8]))
        for engine in (first, second):
            finish(engine)


@st.composite
def fetches(draw) -> tuple[Fetched, int]:
    """A fetch of a full run and, per group, a run of values from its window's start."""
    first = draw(st.integers(0, 6))
    full = draw(st.integers(1, 12))
    window = draw(st.integers(1, 6))  # blocks a group's window needs before an end
    end = first + full
    starts, values = [], []
    for _ in range(draw(st.integers(1, 3))):
        start = max(first, end - window)
        starts.append(start)
        values.append([memoryview(b"")] * draw(st.integers(0, end - start)))
    return Fetched(first, [memoryview(b"")] * full, starts, values), window


@given(fetches())
def test_usable_end_is_served_by_every_group(case) -> None:
    fetched, window = case

    def loaded_from(group: int, end: int) -> int:
        return max(0, end - window)

    end = usable_end(fetched, loaded_from)
    assert fetched.first <= end <= fetched.end
    for start, values in zip(fetched.starts, fetched.windows, strict=True):
        if end > fetched.first:  # a load: each group holds the window before its end
            assert start <= max(fetched.first, loaded_from(0, end))
            assert start + len(values) >= end
    runs = zip(fetched.starts, fetched.windows, strict=True)
    if all(start + len(values) == fetched.end for start, values in runs):
        assert end == fetched.end  # every value there: the whole run loads


def test_tier_events_name_the_full_layers_values_only(tmp_path):
    engine = gemma_engine(kv_tier=f"disk:{tmp_path / 'tier'}")
    events: list = []
    engine.set_event_sink(events.append)
    serve(engine, [DOCUMENT])
    stored = [e for e in events if isinstance(e, BlockStored) and e.medium == "disk"]
    digests = engine.manager.prompt_digests(DOCUMENT)
    assert engine.tier.client.stats.writes == 11 * 3
    assert {digest for event in stored for digest in event.block_hashes} >= set(digests)
    assert sum(len(event.block_hashes) for event in stored) == 11  # not the window values
    finish(engine)
