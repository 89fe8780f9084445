"""The key-component debug log: hits, misses and evictions, and never a token or a word."""

from __future__ import annotations

import json

from engine_fixtures import assert_pool_clean, run_to_completion, tiny_engine
from prefixcache.engine.sampling import SamplingParams

SECRET = "Quartz falcon ledger: the vault opens Thursdays, combination seventy-two."
GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def test_log_has_hits_misses_and_evictions_but_no_prompt(tmp_path):
    path = tmp_path / "keys.jsonl"
    engine = tiny_engine(num_kv_blocks=24, log_cache_keys=str(path))
    prompt = engine.tokenizer.encode(SECRET, add_special_tokens=True)
    for request_id in ("first", "again"):  # the second one hits the first one's blocks
        engine.add_request(request_id, prompt, GREEDY, cache_salt="tenant-a")
        run_to_completion(engine)
    for index in range(4):  # unrelated prompts that need the whole pool: evictions
        engine.add_request(f"other{index}", [300 + index] * 80, GREEDY)
        run_to_completion(engine)
    assert_pool_clean(engine)
    text = path.read_text()
    records = [json.loads(line) for line in text.splitlines()]

    lookups = [r for r in records if r["event"] == "lookup"]
    assert {r["result"] for r in lookups if r["request"] == "first#0"} == {"miss"}
    again = [r for r in lookups if r["request"] == "again#0"]
    assert again[0]["result"] == "hit" and again[0]["refcount"] == 1
    assert again[0]["salt"] and again[0]["salt"] != "tenant-a" and again[0]["parent"]
    evictions = [r for r in records if r["event"] == "evict"]
    assert evictions and {"block_index", "parent", "block_id", "digest"} <= evictions[0].keys()
    assert any(r["request"] == "again#0" for r in evictions)

    for word in SECRET.replace(",", " ").replace(":", " ").replace(".", " ").split():
        if len(word) > 3:
            assert word.lower() not in text.lower(), word
    assert json.dumps(prompt) not in text and "[" not in text  # no list at all, so no ids
    assert "tenant-a" not in text


def test_serve_takes_the_debug_and_isolation_options():
    from prefixcache.cli import build_parser

    args = build_parser().parse_args(["serve", "--log-cache-keys", "k.jsonl", "--zero-on-evict"])
    assert args.log_cache_keys == "k.jsonl" and args.zero_on_evict
    args = build_parser().parse_args(["serve"])
    assert args.log_cache_keys is None and not args.zero_on_evict
