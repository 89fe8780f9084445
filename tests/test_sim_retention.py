"""Retention in the simulator: trace fields, marks applied on the trace's clock, the sweep."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from conftest import REAL_TRACE
from prefixcache.sim.cli import add_simulate_parser, run_simulate
from prefixcache.sim.replay import RetentionModel, replay
from prefixcache.sim.sweep import run_retention_sweep
from prefixcache.sim.traces import LineError, Mark, TokenRequest, Trace, load_trace

BLOCK = 4
SYSTEM = list(range(17))  # 4 full blocks and a partial one (its token computed: rule 10)


def flooded(gap_ms: float = 10_000, marks: list[Mark] | None = None) -> Trace:
    """The system prompt, three unique prompts that flood an 8-block pool, the system prompt
    again ``gap_ms`` later: LRU has evicted it by then, a retention keeps it."""
    requests = [
        TokenRequest(0, SYSTEM, retention=marks or []),
        TokenRequest(1000, list(range(100, 113))),  # 4 blocks each: the unretained half
        TokenRequest(2000, list(range(200, 213))),
        TokenRequest(3000, list(range(300, 313))),
        TokenRequest(gap_ms, SYSTEM),
    ]
    return Trace("<test>", "tokens", requests)


def test_a_ttl_saves_hits_that_lru_loses() -> None:
    plain = replay(flooded(), 8, block_size=BLOCK)
    kept = replay(flooded(), 8, block_size=BLOCK, retention=RetentionModel(300, 0.5))
    assert plain.hits_per_request[-1] == 0 and plain.retention_saved_hits == 0
    assert kept.hits_per_request[-1] == 4 and kept.retention_saved_hits == 4
    assert kept.block_hit_rate > plain.block_hit_rate
    # The budget (half of 8 blocks) is full with the system prompt: each flood's 3 full
    # blocks are refused, so they stay evictable.
    assert kept.retention_refused == 9 and kept.retention_evictions == 0


def test_the_cache_clock_is_the_trace_a_mark_expires_between_requests() -> None:
    short = replay(flooded(), 8, block_size=BLOCK, retention=RetentionModel(0.5, 0.5))
    assert short.hits_per_request[-1] == 0 and short.retention_saved_hits == 0
    assert short.retention_expired > 0


def test_a_budget_of_zero_saves_nothing_and_counts_refusals() -> None:
    none = replay(flooded(), 8, block_size=BLOCK, retention=RetentionModel(300, 0.0))
    plain = replay(flooded(), 8, block_size=BLOCK)
    assert none.retention_saved_hits == 0 and none.retained_blocks == 0
    assert none.retention_refused > 0
    assert none.hits_per_request == plain.hits_per_request


def test_the_traces_own_marks_apply_by_default() -> None:
    marked = replay(flooded(marks=[Mark(17, 300.0)]), 8, block_size=BLOCK)
    assert marked.hits_per_request[-1] == 4 and marked.retention_saved_hits == 4
    two_blocks = replay(flooded(marks=[Mark(9, 300.0)]), 8, block_size=BLOCK)
    assert two_blocks.retained_blocks == 2  # 9 tokens: two full blocks
    ignored = replay(
        flooded(marks=[Mark(17, 300.0)]), 8, block_size=BLOCK, retention=RetentionModel(0)
    )
    assert ignored.retention_saved_hits == 0  # a TTL of 0 models no retention at all


def test_a_prefix_of_n_blocks_retains_only_those() -> None:
    model = RetentionModel(300, 0.5, prefix_blocks=2)
    two = replay(flooded(), 8, block_size=BLOCK, retention=model)
    assert two.hits_per_request[-1] == 2 and two.retention_saved_hits == 2
    assert two.retention_prefix_blocks == 2


def test_the_retention_sweep_has_a_baseline_per_capacity() -> None:
    runs = run_retention_sweep(flooded(), [8], "lru", [0.5, 300], [0.0, 0.5], block_size=BLOCK)
    assert [(r.retention_ttl, r.retention_budget) for r in runs][:1] == [(0.0, 0.5)]
    saved = {(r.retention_ttl, r.retention_budget): r.retention_saved_hits for r in runs}
    assert saved == {(0.0, 0.5): 0, (0.5, 0.0): 0, (0.5, 0.5): 0, (300, 0.0): 0, (300, 0.5): 4}


def write(path: Path, *lines: dict) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


def test_the_fields_are_read_from_both_formats(tmp_path: Path) -> None:
    tokens = write(
        tmp_path / "t.jsonl",
        {"timestamp": 0, "token_ids": [1, 2, 3], "cache_key": 7, "retention": [[3, 300]]},
    )
    request = load_trace(tokens).requests[0]
    assert (request.cache_key, request.retention) == (7, [Mark(3, 300.0)])
    moon = write(
        tmp_path / "m.jsonl",
        {"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2],
         "cache_key": 3, "retention": [[600, 86400]]},
    )  # fmt: skip
    request = load_trace(moon).requests[0]
    assert (request.cache_key, request.retention) == (3, [Mark(600, 86400.0)])
    whole = replay(load_trace(moon), 2, retention=RetentionModel(None, 1.0))
    assert whole.retained_blocks == 2  # the whole input: both ids, the partial one too


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"cache_key": "k"}, "field 'cache_key' must be an integer"),
        ({"cache_key": -1}, "field 'cache_key' must be >= 0"),
        ({"retention": 300}, "field 'retention' must be a list"),
        ({"retention": [[3]]}, "field 'retention[0]' must be [num_tokens, ttl_seconds]"),
        ({"retention": [[0, 5]]}, "field 'retention[0]' num_tokens must be an integer in [1, 3]"),
        ({"retention": [[3, 5], [4, 5]]}, "field 'retention[1]' num_tokens must be an integer"),
        ({"retention": [[3, 0]]}, "field 'retention[0]' ttl_seconds must be a finite number > 0"),
        ({"retention": [[3, "5m"]]}, "field 'retention[0]' ttl_seconds must be a finite"),
    ],
)
def test_bad_fields_are_refused_by_line_and_name(tmp_path: Path, extra: dict, message: str):
    good = {"timestamp": 0, "token_ids": [1, 2, 3]}
    path = write(tmp_path / "bad.jsonl", good, {**good, **extra})
    with pytest.raises(LineError, match="line 2: ") as error:
        load_trace(path)
    assert message in str(error.value)
    moon = {"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [1]}
    path = write(tmp_path / "bad-m.jsonl", {**moon, **extra})
    with pytest.raises(LineError, match="line 1: ") as error:
        load_trace(path)
    assert message.split(" must")[0] in str(error.value)


def simulate(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="prefixcache")
    add_simulate_parser(parser.add_subparsers(dest="command", required=True))
    return run_simulate(parser.parse_args(["simulate", *argv]))


def test_simulate_sweeps_ttls_and_budgets(tmp_path: Path, capsys) -> None:
    lines = [{"timestamp": r.timestamp, "token_ids": r.token_ids} for r in flooded().requests]
    trace = write(tmp_path / "t.jsonl", *lines)
    out_file = tmp_path / "r.json"
    argv = [str(trace), "--capacity", "8", "--block-size", "4", "--policy", "lru", "--quiet"]
    assert simulate(*argv, "--retention-ttl", "300", "--retention-budget", "0", "0.5",
                    "--out", str(out_file)) == 0  # fmt: skip
    out = capsys.readouterr().out
    table = out[out.index("retention (") :].splitlines()
    assert "prefix" in table[1].split()
    assert table[1].split()[:3] == ["capacity", "ttl", "s"]
    assert [row.split()[:3] for row in table[2:5]] == [
        ["8", "none", "-"], ["8", "300", "0"], ["8", "300", "0.5"]
    ]  # fmt: skip
    assert table[4].split()[6] == "4"  # saved hits
    saved = [run["retention_saved_hits"] for run in json.loads(out_file.read_text())["retention"]]
    assert saved == [0, 0, 4]
    assert simulate(*argv, "--retention-ttl", "300", "--retain-prefix-blocks", "2", "9") == 0
    rows = capsys.readouterr().out.split("retention (")[1].splitlines()[2:5]
    assert [(row.split()[3], row.split()[6]) for row in rows] == [
        ("-", "0"),
        ("2", "2"),
        ("9", "4"),
    ]


def test_simulate_refuses_a_bad_budget_or_ttl(tmp_path: Path, capsys) -> None:
    trace = write(tmp_path / "t.jsonl", {"timestamp": 0, "token_ids": [1, 2, 3]})
    for flag, value, message in [
        ("--retention-budget", "2", "must be in [0, 1]"),
        ("--retention-ttl", "-1", "must be a finite number >= 0"),
    ]:
        with pytest.raises(SystemExit):
            simulate(str(trace), flag, value, "--quiet")
        assert message in capsys.readouterr().err


def test_the_mooncake_trace_still_replays_with_retention() -> None:
    trace = load_trace(REAL_TRACE)
    trace = Trace(trace.path, trace.kind, trace.requests[:2000])
    plain = replay(trace, 2000)
    kept = replay(trace, 2000, retention=RetentionModel(300, 0.5))
    assert plain.blocks == kept.blocks > 0
    assert kept.retained_blocks > 0 and kept.retention_saved_hits > 0
