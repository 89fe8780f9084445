"""Tenant isolation knobs: a minimum shared span for hits, and zeroing evicted K/V."""

from __future__ import annotations

import json

import openai
import pytest
import torch

from conftest import admit_computed
from engine_fixtures import assert_pool_clean, run_to_completion, tiny_engine
from prefixcache.engine.sampling import SamplingParams
from prefixcache.protocol.auth import Tenants
from server_fixtures import running_server, wait_idle

GREEDY = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


# ------------------------------------------------------------ minimum shared span
def test_a_hit_shorter_than_min_hit_tokens_is_a_miss(make_manager):
    manager = make_manager(num_blocks=10, block_size=4)
    manager.free(admit_computed(manager, "a", list(range(1, 13))))
    probe = list(range(1, 9)) + [50, 51, 52]  # shares 2 blocks (8 tokens) with "a"
    assert manager.match(probe) == 8
    assert manager.match(probe, min_hit_tokens=9) == 0
    assert manager.match(probe, min_hit_tokens=8) == 8
    before = manager.stats.hits
    strict = manager.admit("strict", probe, min_hit_tokens=9)
    assert strict.num_cached_tokens == 0 and manager.stats.hits == before
    assert len(set(strict.block_table)) == 3  # all fresh: nothing shared with "a"
    manager.commit(strict, len(probe))
    manager.free(strict)
    loose = manager.admit("loose", probe, min_hit_tokens=8)
    assert loose.num_cached_tokens == 8
    manager.free(loose)
    manager.check_invariants()


def test_the_engine_recomputes_short_hits():
    engine = tiny_engine()
    prompt = list(range(200, 230))
    engine.add_request("a", prompt, GREEDY)
    first = run_to_completion(engine)["a"]
    engine.add_request("short", prompt, GREEDY, min_hit_tokens=100)
    engine.add_request("long", prompt + [7], GREEDY, min_hit_tokens=16)
    done = run_to_completion(engine)
    assert done["short"].num_cached_tokens == 0 and done["long"].num_cached_tokens == 28
    assert done["short"].token_ids == first.token_ids  # recomputed, same answer
    with pytest.raises(ValueError, match="min_hit_tokens must be an int >= 0"):
        engine.add_request("bad", prompt, GREEDY, min_hit_tokens=-1)
    assert_pool_clean(engine)


# ----------------------------------------------------------------- zero on evict
@pytest.mark.parametrize(
    ("zero_all", "zero_this", "zeroed"),
    [(False, False, False), (True, False, True), (False, True, True)],
)
def test_an_evicted_block_is_zeroed_only_when_asked(zero_all, zero_this, zeroed):
    engine = tiny_engine(num_kv_blocks=8, block_size=4, zero_on_evict=zero_all)
    engine.add_request("a", list(range(300, 309)), GREEDY, zero_on_evict=zero_this)
    engine.step()  # prefill: blocks 0 and 1 hold a's K/V for positions 0-7
    table = list(engine.requests["a"].branches[0].seq.block_table)
    run_to_completion(engine)
    victim = table[1]  # LRU evicts the deeper cached block first
    old = [layer[victim].clone() for layer in engine.kv_store.layers]
    # 25 tokens need 7 blocks: the victim becomes b's last block, where b writes slots 0-1
    engine.add_request("b", list(range(400, 425)), GREEDY)
    engine.step()
    assert engine.manager.stats.evictions >= 1
    assert engine.requests["b"].branches[0].seq.block_table[-1] == victim
    run_to_completion(engine)
    for layer, before in zip(engine.kv_store.layers, old, strict=True):
        stale = layer[victim][:, 2:]  # K and V of slots 2-3, never written by b
        assert bool(stale.abs().sum() > 0) != zeroed
        if not zeroed:
            assert torch.equal(stale, before[:, 2:])
    assert_pool_clean(engine)


# -------------------------------------------------------- through the HTTP server
SYSTEM = "Zebra railway assistant: answer carefully and briefly. " * 6
KEYS = {
    "alpha": {"keys": ["sk-alpha"]},
    "strict": {"keys": ["sk-strict"], "min_hit_tokens": 1000},
    "vault": {"keys": ["sk-vault"], "zero_on_evict": True},
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    path.write_text(json.dumps({"tenants": [{"name": n, **v} for n, v in KEYS.items()]}))
    engine = tiny_engine(num_kv_blocks=400, block_size=4)
    with running_server(engine, Tenants.from_file(path)) as (url, state):
        yield url, state


def cached_tokens(url: str, key: str, question: str) -> int:
    api = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    reply = api.chat.completions.create(
        model="tiny",
        max_tokens=2,
        temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        extra_body={"ignore_eos": True},
    )
    return reply.usage.prompt_tokens_details.cached_tokens


def test_min_hit_tokens_and_zero_on_evict_tenants_through_the_server(served):
    url, state = served
    for key in ("sk-alpha", "sk-strict"):
        cached_tokens(url, key, "First?")
    assert cached_tokens(url, "sk-alpha", "Second?") > 40  # a plain tenant reuses
    assert cached_tokens(url, "sk-strict", "Second?") == 0  # shorter than 1000: recomputed
    assert not state.engine.scrubber.active
    cached_tokens(url, "sk-vault", "First?")
    assert cached_tokens(url, "sk-vault", "Second?") > 40  # zero_on_evict still reuses its own
    assert state.engine.scrubber.active and state.engine.scrubber.written
    wait_idle(state)


def test_key_file_rejects_a_negative_min_hit_tokens(tmp_path):
    path = tmp_path / "keys.json"
    tenant = {"name": "x", "keys": ["k"], "min_hit_tokens": -1}
    path.write_text(json.dumps({"tenants": [tenant]}))
    with pytest.raises(ValueError, match="min_hit_tokens must be an integer >= 0"):
        Tenants.from_file(path)
