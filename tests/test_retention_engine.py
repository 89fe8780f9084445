"""The engine keeps what a request asked to retain (``Keep``), through a flood, until expiry."""

from __future__ import annotations

import pytest

from clock_fixtures import FakeClock
from engine_fixtures import assert_pool_clean, run_to_completion, tiny_engine
from prefixcache.cache.retention import Keep
from prefixcache.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=2, temperature=0.0)


def _run(engine, request_id, prompt, owner, retention=()):
    engine.add_request(request_id, prompt, GREEDY, owner=owner, retention=retention)
    return run_to_completion(engine)[request_id]


def _flood(engine, rounds: int = 6) -> None:
    """Another owner's distinct prompts, more tokens than the pool holds."""
    for i in range(rounds):
        prompt = [100 + 37 * i + j for j in range(40)]
        _run(engine, f"flood-{i}", prompt, "flood")


def test_a_retained_prefix_survives_a_flood_and_an_unmarked_one_does_not():
    clock = FakeClock()
    engine = tiny_engine(num_kv_blocks=24, retention_clock=clock)
    system, document = list(range(1, 17)), list(range(500, 516))
    _run(engine, "sys", system + [900], "a", retention=(Keep(16, 3600.0, "1h"),))
    _run(engine, "doc", document + [901], "a")
    assert engine.manager.retained_blocks() == 4
    _flood(engine)
    assert _run(engine, "sys-again", system + [902], "a").num_cached_tokens == 16
    assert _run(engine, "doc-again", document + [903], "a").num_cached_tokens == 0
    assert engine.manager.stats.retention_saved_hits >= 1
    clock.now += 3601
    _flood(engine)
    assert _run(engine, "sys-late", system + [904], "a").num_cached_tokens == 0
    assert engine.manager.retained_blocks() == 0
    assert_pool_clean(engine)


def test_the_budget_caps_what_one_owner_retains():
    engine = tiny_engine(
        num_kv_blocks=24, retention_budgets={"a": 0.25}, retention_clock=FakeClock()
    )
    long_prompt = list(range(1, 41))
    _run(engine, "big", long_prompt + [7], "a", retention=(Keep(40, 300.0),))
    assert engine.manager.retained_blocks() == 6  # 0.25 * 24 of the 10 asked
    assert engine.manager.stats.retention_refused == 4
    assert_pool_clean(engine)


@pytest.mark.parametrize(
    ("keeps", "message"),
    [
        ((Keep(99, 60.0),), "past the prompt"),
        ((Keep(4, -1.0),), "ttl_seconds"),
        (tuple(Keep(4, 60.0) for _ in range(9)), "at most 8"),
    ],
)
def test_a_bad_retention_is_refused_by_name(keeps, message):
    engine = tiny_engine()
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", [1, 2, 3, 4, 5], GREEDY, retention=keeps)
    assert_pool_clean(engine)
