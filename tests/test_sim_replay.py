"""Replay through the real manager, Belady's bound, and the simulate command end to end."""

from __future__ import annotations

import argparse
import csv
import json
from itertools import combinations
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import REAL_TRACE
from prefixcache.cache.policies import POLICY_NAMES
from prefixcache.sim.belady import belady_hits, infinite_hits, next_uses
from prefixcache.sim.cli import add_simulate_parser, run_simulate
from prefixcache.sim.replay import block_references, replay
from prefixcache.sim.traces import MooncakeRequest, TokenRequest, Trace, load_trace


def mooncake_trace(*requests: list[int], input_lengths: list[int] | None = None) -> Trace:
    """A Mooncake trace from id lists; inputs fill every block unless lengths are given."""
    lengths = input_lengths or [512 * len(ids) for ids in requests]
    rows = [
        MooncakeRequest(t, n, 0, list(ids))
        for t, (ids, n) in enumerate(zip(requests, lengths, strict=True))
    ]
    return Trace("<test>", "mooncake", rows)


# ------------------------------------------------------------------ replay
def test_mooncake_replay_hand_computed_lru():
    trace = mooncake_trace(
        [0, 1, 2], [0, 1, 3], [4, 5], [0, 1, 2], input_lengths=[1500, 1300, 600, 1500]
    )
    result = replay(trace, 4, "lru")
    # r1 reuses 0,1; r2 evicts 2 then 3 (deepest first); r3 reuses 0,1, and 2 is gone.
    assert result.hits_per_request == [0, 2, 0, 2]
    assert (result.hit_blocks, result.blocks) == (4, 11)
    assert (result.hit_tokens, result.tokens) == (2 * 1024, 4900)
    assert result.evictions == 3
    assert result.peak_usage == 0.75 and result.peak_cached_blocks == 4


def test_mooncake_replay_has_no_last_token_cap_and_counts_the_partial_block():
    trace = mooncake_trace([7, 8], [7, 8], input_lengths=[700, 700])
    result = replay(trace, 2, "lru")
    assert result.hits_per_request == [0, 2]  # the whole request, last block included
    assert result.hit_tokens == 700  # 512 + the partial block's 188


def test_token_replay_follows_the_engine_rules():
    requests = [
        TokenRequest(0, [1, 2, 3, 4, 5], [6, 7]),
        TokenRequest(1, [1, 2, 3, 4, 5, 6, 7, 8], tenant="a"),  # turn 2 hits turn 1's output
        TokenRequest(2, [1, 2, 3, 4], cache_salt="x"),  # another salt: nothing shared
        TokenRequest(3, [1, 2, 3, 4], tenant="b"),  # capped: the last token is computed
    ]
    result = replay(Trace("<test>", "tokens", requests), 8, "lru", block_size=2)
    assert result.hits_per_request == [0, 3, 0, 1]
    assert (result.hit_tokens, result.tokens) == (8, 21)
    assert (result.hit_blocks, result.blocks) == (4, 11)
    assert result.tenants == {"a": [8, 6], "b": [4, 2]}


def test_outputs_that_do_not_fit_are_cut_where_the_pool_ends():
    requests = [TokenRequest(0, [1, 2, 3], list(range(10, 30))), TokenRequest(1, [1, 2, 3, 10])]
    result = replay(Trace("<test>", "tokens", requests), 3, "lru", block_size=2)
    assert result.hits_per_request == [0, 1]


def test_capacity_below_the_largest_request_is_refused():
    with pytest.raises(ValueError, match=r"capacity 2 is below the largest request \(3 blocks\)"):
        replay(mooncake_trace([0, 1, 2]), 2)


# ----------------------------------------------------------------- optimum
def test_belady_hand_computed():
    # Capacity 2, single blocks 0 1 2 0 1: LRU hits nothing; MIN evicts 1 (needed last)
    # when 2 arrives, hits 0, and misses 1.
    requests = [[0], [1], [2], [0], [1]]
    assert next_uses(requests) == [[3], [4], [5], [5], [5]]
    assert belady_hits(requests, 2) == 1
    assert replay(mooncake_trace(*requests), 2, "lru").hit_blocks == 0
    # Ties go deepest first, so the cached part stays a prefix: 0 survives, 1 goes.
    assert belady_hits([[0, 1], [2, 3], [0, 1]], 3) == 1
    assert belady_hits([[0, 1, 2], [3], [0, 1, 4]], 3) == 2
    assert infinite_hits([[0, 1, 2], [3], [0, 1, 4]]) == 2


@st.composite
def chained_requests(draw, max_requests: int = 10, max_fresh: int = 4) -> list[list[int]]:
    """Prefix-chained requests: each a prefix of an earlier one plus fresh ids."""
    requests: list[list[int]] = []
    fresh = 0
    for _ in range(draw(st.integers(1, max_requests))):
        prefix: list[int] = []
        if requests and draw(st.booleans()):
            base = draw(st.sampled_from(requests))
            prefix = base[: draw(st.integers(0, len(base)))]
        count = draw(st.integers(0 if prefix else 1, max_fresh))
        requests.append(prefix + list(range(fresh, fresh + count)))
        fresh += count
    return requests


@settings(max_examples=120, deadline=None)
@given(chained_requests(), st.integers(0, 6))
def test_belady_is_never_below_any_policy(requests, slack):
    capacity = max(len(ids) for ids in requests) + slack
    bound = belady_hits(requests, capacity)
    trace = mooncake_trace(*requests)
    for policy in POLICY_NAMES:
        assert replay(trace, capacity, policy).hit_blocks <= bound, policy
    assert bound <= infinite_hits(requests)


def brute_force_optimum(requests: list[list[int]], capacity: int) -> int:
    """Best prefix hits over every eviction choice (keeping more never hurts)."""
    states = {frozenset(): 0}
    for ids in requests:
        need = frozenset(ids)
        following: dict[frozenset, int] = {}
        for cached, score in states.items():
            hits = next((i for i, block in enumerate(ids) if block not in cached), len(ids))
            optional = sorted(cached - need)
            for kept in combinations(optional, min(capacity - len(need), len(optional))):
                state = need | frozenset(kept)
                following[state] = max(following.get(state, -1), score + hits)
        states = following
    return max(states.values())


@settings(max_examples=120, deadline=None)
@given(chained_requests(max_requests=6, max_fresh=3), st.integers(0, 2))
def test_belady_is_the_exact_optimum_on_tiny_traces(requests, slack):
    capacity = max(len(ids) for ids in requests) + slack
    assert belady_hits(requests, capacity) == brute_force_optimum(requests, capacity)


def test_token_references_chain_salted_blocks_and_outputs():
    requests = [
        TokenRequest(0, [1, 2, 3], [4]),
        TokenRequest(1, [1, 2, 3, 4, 5]),
        TokenRequest(2, [1, 2], cache_salt="s"),
    ]
    references = block_references(Trace("<test>", "tokens", requests), 8, 2)
    assert references == [[0, 1], [0, 1], [2]]


# ------------------------------------------------------------- real trace
@pytest.fixture(scope="module")
def real_trace() -> Trace:
    return load_trace(REAL_TRACE)


@pytest.mark.parametrize(
    ("capacity", "lru", "optimum"), [(5000, 27.93, 52.56), (20000, 57.18, 63.96)]
)
def test_reference_figures_on_the_real_trace(real_trace, capacity, lru, optimum):
    result = replay(real_trace, capacity, "lru")
    assert round(100 * result.block_hit_rate, 2) == lru
    references = block_references(real_trace, capacity)
    assert round(100 * belady_hits(references, capacity) / result.blocks, 2) == optimum
    assert round(100 * infinite_hits(references) / result.blocks, 2) == 63.96


# ----------------------------------------------------------------- the CLI
def simulate(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="prefixcache")
    add_simulate_parser(parser.add_subparsers(dest="command", required=True))
    return run_simulate(parser.parse_args(["simulate", *argv]))


def write_token_trace(path: Path) -> Path:
    lines = [
        {"timestamp": 0, "token_ids": list(range(40)), "output_token_ids": [7, 8]},
        {"timestamp": 1, "token_ids": list(range(40)) + [7, 8, 9], "tenant": "a"},
        {"timestamp": 2, "token_ids": list(range(100, 140)), "cache_salt": "s"},
        {"timestamp": 3, "token_ids": list(range(30)) + [1, 2]},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


def test_simulate_prints_the_table_and_writes_json_csv_and_png(tmp_path, capsys):
    trace = write_token_trace(tmp_path / "t.jsonl")
    args = [str(trace), "--capacity", "3", "8", "--block-size", "16", "--quiet"]
    assert simulate(*args, "--index", "hash", "radix", "--out", str(tmp_path / "r.json")) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.split()[:1] == ["capacity"])
    assert header.split() == ["capacity", *POLICY_NAMES, "optimum"]
    assert "identical hits across indexes: yes" in out
    data = json.loads((tmp_path / "r.json").read_text())
    assert len(data["results"]) == 2 * len(POLICY_NAMES) * 2
    assert [item["capacity"] for item in data["optimum"]] == [3, 8]
    files = ["--out", str(tmp_path / "r.csv"), "--plot", str(tmp_path / "p.png")]
    assert simulate(*args, "--policy", "lru", *files) == 0
    rows = list(csv.DictReader((tmp_path / "r.csv").read_text().splitlines()))
    assert [(row["capacity"], row["policy"]) for row in rows] == [
        ("3", "lru"),
        ("8", "lru"),
        ("3", "optimum"),
        ("8", "optimum"),
    ]
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_reports_bad_input_in_one_line(tmp_path, capsys):
    trace = write_token_trace(tmp_path / "t.jsonl")
    assert simulate(str(trace), "--capacity", "2", "--quiet") == 2
    assert "capacity 2 is below the largest request (3 blocks)" in capsys.readouterr().err
    assert simulate(str(trace), "--out", str(tmp_path / "r.txt"), "--quiet") == 2
    assert "suffix must be .json or .csv" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text('{"timestamp": 0, "token_ids": []}\n')
    assert simulate(str(tmp_path / "bad.jsonl"), "--quiet") == 2
    assert "line 1: field 'token_ids' is empty" in capsys.readouterr().err
