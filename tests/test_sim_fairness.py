"""The simulator's tenants: splitting a trace, fair replays, Jain's index, the CLI table."""

from __future__ import annotations

import argparse
import json
import random

import pytest

from prefixcache.cache.policies import POLICY_NAMES
from prefixcache.sim.cli import add_simulate_parser, run_simulate
from prefixcache.sim.fairness import jain_index, tenant_hit_rates, tenants_of
from prefixcache.sim.replay import replay
from prefixcache.sim.traces import MooncakeRequest, TokenRequest, Trace, split_tenants

BLOCK = 16


def flood_trace() -> Trace:
    """A sends a 1,000-token system prompt now and then; B floods unique 500-token prompts."""
    rng = random.Random(0)
    system = [rng.randrange(1, 50_000) for _ in range(1000)]
    requests = []
    for turn in range(6):
        requests.append(TokenRequest(len(requests), system + [turn] * 20, tenant="A"))
        for _ in range(20):  # 10,000 tokens between A's turns, 2.5x a 256-block pool
            prompt = [rng.randrange(1, 50_000) for _ in range(500)]
            requests.append(TokenRequest(len(requests), prompt, tenant="B"))
    return Trace("<flood>", "tokens", requests)


def test_jain_index():
    assert jain_index([0.5, 0.5, 0.5]) == 1.0
    assert jain_index([1.0, 0.0, 0.0]) == pytest.approx(1 / 3)
    assert jain_index([]) == jain_index([0.0, 0.0]) == 1.0


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_a_fair_replay_keeps_the_prompt_a_flood_flushes(policy):
    trace = flood_trace()
    shared = tenant_hit_rates(replay(trace, 256, policy))
    fair_run = replay(trace, 256, policy, owner_shares={})
    fair = tenant_hit_rates(fair_run)
    if policy == "lru":
        assert shared["A"] == 0.0  # every turn of A recomputes its prompt
    assert shared["A"] < 0.5  # the adaptive policies learn to keep some of it, late
    assert fair["A"] == pytest.approx(5 * 992 / (6 * 1020))  # all turns after the first hit
    assert fair["B"] == shared["B"] == 0.0 and fair_run.fair
    assert jain_index(list(fair.values())) < 1.0  # fairness of space, not of hit rates


def test_split_tenants_hashes_the_first_block():
    requests = [
        MooncakeRequest(0, 1024, 0, [1, 2]),
        MooncakeRequest(1, 1024, 0, [1, 3]),  # same first block: same tenant
        *(MooncakeRequest(2 + i, 512, 0, [100 + i]) for i in range(40)),
    ]
    split = split_tenants(Trace("<m>", "mooncake", requests), 3, BLOCK)
    assert split.requests[0].tenant == split.requests[1].tenant
    assert tenants_of(split) == ["t0", "t1", "t2"]
    assert split_tenants(Trace("<m>", "mooncake", requests), 3, BLOCK).requests == split.requests
    tokens = [TokenRequest(0, [1] * 20), TokenRequest(1, [1] * 16 + [2]), TokenRequest(2, [2])]
    tenants = [r.tenant for r in split_tenants(Trace("<t>", "tokens", tokens), 50, 16).requests]
    assert tenants[0] == tenants[1]  # the same first 16 tokens
    with pytest.raises(ValueError, match="--tenants must be >= 1, got 0"):
        split_tenants(split, 0, BLOCK)


# ----------------------------------------------------------------- the command
def simulate(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="prefixcache")
    add_simulate_parser(parser.add_subparsers(dest="command", required=True))
    return run_simulate(parser.parse_args(["simulate", *argv]))


def write(path, trace: Trace) -> str:
    rows = [
        {"timestamp": r.timestamp, "token_ids": r.token_ids, "tenant": r.tenant}
        for r in trace.requests
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_simulate_prints_per_tenant_rates_with_and_without_shares(tmp_path, capsys):
    trace = write(tmp_path / "flood.jsonl", flood_trace())
    out = tmp_path / "r.json"
    args = ["--capacity", "256", "--policy", "lru", "--no-optimum", "--quiet", "--out", str(out)]
    assert simulate(trace, *args, "--cache-share", "A=0.5") == 0
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("tenant fairness"))
    assert "2 tenants; shares: A 0.5, the rest split equally" in lines[start]
    assert lines[start + 1].split() == ["capacity", "policy", "pool", "A", "B", "all", "Jain"]
    shared, fair = (line.split() for line in lines[start + 2 : start + 4])
    assert shared[:4] == ["256", "lru", "shared", "0.00"] and fair[:3] == ["256", "lru", "fair"]
    assert float(fair[3]) == pytest.approx(100 * 5 * 992 / (6 * 1020), abs=0.01)
    saved = json.loads(out.read_text())["fairness"]
    assert saved[0]["fair"]["tenant_hit_rates"]["A"] > 0.8 and saved[0]["policy"] == "lru"


def test_simulate_splits_a_mooncake_trace_into_tenants(tmp_path, capsys):
    rows = [
        {"timestamp": t, "input_length": 1024, "output_length": 1, "hash_ids": [t % 7, 100 + t]}
        for t in range(60)
    ]
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert (
        simulate(str(path), "--tenants", "3", "--capacity", "8", "--policy", "lru", "--quiet") == 0
    )
    out = capsys.readouterr().out
    assert "tenant fairness: token hit rate (%) per tenant, 3 tenants" in out
    assert simulate(str(path), "--capacity", "8", "--policy", "lru", "--quiet") == 0
    assert "tenant fairness" not in capsys.readouterr().out  # no tenants, no table


def test_simulate_refuses_shares_for_unknown_tenants_and_bad_sums(tmp_path, capsys):
    trace = write(tmp_path / "flood.jsonl", flood_trace())
    base = [trace, "--capacity", "256", "--policy", "lru", "--no-optimum", "--quiet"]
    assert simulate(*base, "--cache-share", "C=0.5") == 2
    assert (
        "--cache-share names ['C'], not tenants of the trace ['A', 'B']" in capsys.readouterr().err
    )
    assert simulate(*base, "--cache-share", "A=0.7", "B=0.7") == 2
    assert "cache shares sum to 1.4; at most 1" in capsys.readouterr().err
