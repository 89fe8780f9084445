"""The other public trace formats: Mooncake's variants, Alibaba's Bailian, our CSV; sessions.

Each fixture is a few lines built to the real files' field layout (no real data copied).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixcache.cli import main
from prefixcache.sim.replay import replay
from prefixcache.sim.sweep import summarize
from prefixcache.sim.synth import SynthConfig, synth_trace, write_trace
from prefixcache.sim.trace_formats import detect_format
from prefixcache.sim.traces import load_trace


def write_json_lines(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def write_text(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def mooncake(timestamp, input_length, hash_ids, **extra) -> dict:
    return {"timestamp": timestamp, "input_length": input_length, "output_length": 7,
            "hash_ids": hash_ids, **extra}  # fmt: skip


# conversation_trace.jsonl: a shared first id 0, round timestamps; the arXiv
# mooncake_trace.jsonl: the same fields, timestamps far from 0; synthetic_trace.jsonl:
# ids that need not start at 0, uneven timestamps; NVIDIA's tools add "session_id".
MOONCAKE_VARIANTS = {
    "conversation": [mooncake(0, 1200, [0, 1, 2]), mooncake(3000, 1300, [0, 1, 3])],
    "arxiv": [mooncake(1178625, 1200, [0, 1, 2]), mooncake(1181678, 1300, [0, 1, 3])],
    "synthetic": [mooncake(40, 1200, [79, 80, 81]), mooncake(277, 1100, [79, 80, 82])],
    "sessions": [
        mooncake(0, 1200, [0, 1, 2], session="conv-a"),
        mooncake(5, 1300, [0, 1, 3], session_id=7),
    ],
}


@pytest.mark.parametrize("variant", sorted(MOONCAKE_VARIANTS))
def test_every_mooncake_variant_replays_with_its_shared_prefix_hit(tmp_path, variant):
    path = write_json_lines(tmp_path / f"{variant}.jsonl", MOONCAKE_VARIANTS[variant])
    trace = load_trace(path)
    assert detect_format(path) == "mooncake" and trace.format_name == "mooncake"
    assert summarize(trace, 16)["block_size"] == 512
    result = replay(trace, 16)
    assert (result.blocks, result.hit_blocks, result.hit_tokens) == (6, 2, 2 * 512)
    sessions = [r.session for r in trace.requests]
    assert sessions == (["conv-a", "7"] if variant == "sessions" else [None, None])


def bailian(chat, parent, timestamp, input_length, hash_ids, turn=1) -> dict:
    return {"chat_id": chat, "parent_chat_id": parent, "timestamp": timestamp,
            "input_length": input_length, "output_length": 11, "type": "text", "turn": turn,
            "hash_ids": hash_ids}  # fmt: skip


BAILIAN = [
    bailian(1, -1, 0.5, 30, [5, 6]),
    bailian(2, 1, 61.114, 60, [5, 6, 7, 8], turn=2),
    bailian(4, -1, 61.2, 20, [6, 5]),  # the same block hashes in another order: no prefix
    bailian(3, 2, 62.0, 70, [5, 6, 7, 8, 9], turn=3),
    bailian(9, 55, 70.0, 16, [10], turn=4),  # its chain began before the trace
]


def test_bailian_chains_give_one_session_per_conversation_and_16_token_hits(tmp_path):
    path = write_json_lines(tmp_path / "qwen_traceA_blksz_16.jsonl", BAILIAN)
    trace = load_trace(path)
    assert detect_format(path) == "bailian" and trace.format_name == "bailian"
    assert [r.session for r in trace.requests] == ["1", "1", "4", "1", "55"]
    stamps = [round(r.timestamp, 6) for r in trace.requests]
    assert stamps == [500.0, 61114.0, 61200.0, 62000.0, 70000.0]  # seconds -> ms
    hashes = [r.hash_ids for r in trace.requests]
    assert hashes[1][:2] == hashes[0] and hashes[2][0] != hashes[0][0]  # re-numbered chains
    result = replay(trace, 32)
    assert result.hits_per_request == [0, 2, 0, 4, 0]
    assert result.hit_tokens == 2 * 16 + 4 * 16
    assert result.tokens == 30 + 60 + 20 + 70 + 16
    assert summarize(trace, 4)["block_size"] == 16  # --out reports the trace's own block


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"chat_id": None}, r"line 1: field 'chat_id' must be an integer >= 0, got None"),
        ({"parent_chat_id": -2}, r"field 'parent_chat_id' must be an integer >= -1"),
        ({"timestamp": "61.1"}, r"field 'timestamp' must be a number \(s\)"),
        ({"turn": 0}, r"field 'turn' must be >= 1"),
        ({"type": 3}, r"field 'type' must be a string"),
        ({"input_length": 100}, r"'hash_ids' has 2 ids but input_length 100 needs 7 blocks of 16"),
    ],
)
def test_bad_bailian_lines_name_the_field(tmp_path, change, message):
    record = {**bailian(1, -1, 0.5, 30, [5, 6]), **change}
    path = write_json_lines(tmp_path / "bad.jsonl", [record])
    with pytest.raises(ValueError, match=message) as error:
        load_trace(path, "bailian")
    assert str(error.value).startswith(f"{path}, line 1: ")


CSV = [
    "timestamp,session,block_ids,tenant,input_length,output_length",
    "0,s1,0 1,acme,30,5",
    "",
    "1000.5,s1,0 1 2 3,acme,60,9",
    "1500,,7,,,",
    "2000,s2,0 1 4,beta,,",
]


def test_csv_rows_replay_as_16_token_blocks_with_sessions_and_tenants(tmp_path):
    path = write_text(tmp_path / "mine.csv", CSV)
    trace = load_trace(path)
    assert detect_format(path) == "csv" and trace.format_name == "csv"
    assert [r.session for r in trace.requests] == ["s1", "s1", None, "s2"]
    assert [r.tenant for r in trace.requests] == ["acme", "acme", None, "beta"]
    assert [r.input_length for r in trace.requests] == [30, 60, 16, 48]  # default: full blocks
    assert [r.output_length for r in trace.requests] == [5, 9, 0, 0]
    result = replay(trace, 32)
    assert result.hits_per_request == [0, 2, 0, 2]
    assert result.hit_tokens == 4 * 16
    assert set(result.tenants) == {"acme", "beta"}


def test_csv_block_size_is_the_option_and_only_required_columns_are_needed(tmp_path):
    path = write_text(tmp_path / "min.csv", ["block_ids,timestamp,session", "0 1,0,a", "0 2,1,b"])
    trace = load_trace(path, "csv", block_size=4)
    assert [r.input_length for r in trace.requests] == [8, 8]
    assert replay(trace, 8).hit_tokens == 4


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (["timestamp,session", "0,a"], r"line 1: column 'block_ids' is missing from the header"),
        (["timestamp,session,block_ids,prompt"], r"line 1: column 'prompt' is not one of"),
        (["timestamp,session,block_ids,session"], r"column 'session' appears twice"),
        (["timestamp,session,block_ids", "soon,a,0"], r"line 2: column 'timestamp' must be a num"),
        (["timestamp,session,block_ids", "nan,a,0"], r"column 'timestamp' must be a number \(ms\)"),
        (["timestamp,session,block_ids", "-1,a,0"], r"column 'timestamp' must be >= 0"),
        (["timestamp,session,block_ids", "0,a,0 x"], r"column 'block_ids\[1\]' must be an integer"),
        (["timestamp,session,block_ids", "0,a,"], r"column 'block_ids' is empty"),
        (["timestamp,session,block_ids", "0,a,0 1", "1,b,2 1"], r"line 3: column 'block_ids'"),
        (["timestamp,session,block_ids", "0,a"], r"line 2: has 2 columns, the header 3"),
        (["timestamp,session,block_ids,input_length", "0,a,0 1,100"],
         r"column 'block_ids' has 2 ids but input_length 100 needs 7 blocks of 16"),
        (["timestamp,session,block_ids", f"0,{'s' * 257},0"],
         r"column 'session' has 257 characters, more than 256"),
    ],
)  # fmt: skip
def test_bad_csv_rows_name_the_column(tmp_path, lines, message):
    path = write_text(tmp_path / "bad.csv", lines)
    with pytest.raises(ValueError, match=message) as error:
        load_trace(path)
    assert str(error.value).startswith(f"{path}, line ")


def test_sessions_are_strings_of_at_most_256_characters_or_integers(tmp_path):
    tokens = {"timestamp": 0, "token_ids": [1, 2]}
    path = write_json_lines(tmp_path / "t.jsonl", [{**tokens, "session": 12}])
    assert load_trace(path).requests[0].session == "12"
    for bad, message in [
        (["x"], "must be a string or an integer"),
        ("x" * 300, "has 300 characters"),
    ]:
        path = write_json_lines(tmp_path / "t.jsonl", [{**tokens, "session": bad}])
        with pytest.raises(ValueError, match=f"line 1: field 'session' {message}"):
            load_trace(path)
        path = write_json_lines(tmp_path / "m.jsonl", [mooncake(0, 10, [0], session=bad)])
        with pytest.raises(ValueError, match=f"line 1: field 'session' {message}"):
            load_trace(path)


def test_a_first_line_of_no_known_format_is_refused(tmp_path):
    path = write_text(tmp_path / "x.txt", ["when,who", "0,a"])
    with pytest.raises(ValueError, match="line 1: neither a JSON object nor a CSV header"):
        load_trace(path)


@pytest.mark.parametrize("trace_format", ["mooncake", "tokens"])
def test_synth_traces_carry_each_conversation_as_a_session(tmp_path, trace_format):
    config = SynthConfig(conversations=40, single_turn_share=0.0, system_tokens=200, seed=3)
    path = tmp_path / "synth.jsonl"
    write_trace(synth_trace(config, trace_format), path)
    requests = load_trace(path, trace_format).requests
    sessions = [r.session for r in requests]
    assert set(sessions) == {str(n) for n in range(40)}
    assert len(requests) > 40  # multi-turn: a session spans several requests
    first: dict = {}
    for request in requests:
        first.setdefault(request.session, request)
    if trace_format == "tokens":  # a later turn resends its conversation's first prompt
        for request in requests:
            prompt = first[request.session].token_ids
            assert request.token_ids[: len(prompt)] == prompt


@pytest.mark.parametrize(
    ("name", "lines", "shown"),
    [
        ("m.jsonl", [json.dumps(r) for r in MOONCAKE_VARIANTS["conversation"]], "(mooncake)"),
        ("b.jsonl", [json.dumps(r) for r in BAILIAN], "(bailian)"),
        ("c.csv", CSV, "(csv)"),
    ],
)
def test_simulate_reads_each_format(tmp_path, capsys, name, lines, shown):
    path = write_text(tmp_path / name, lines)
    assert (
        main(["simulate", str(path), "--capacity", "32", "--quiet", "--index", "hash", "radix"])
        == 0
    )
    out = capsys.readouterr().out
    assert f"trace {path} {shown}" in out and "optimum" in out
    explicit = ["--trace-format", shown.strip("()"), "--no-optimum", "--no-fairness"]
    assert main(["simulate", str(path), "--capacity", "32", "--quiet", *explicit]) == 0
    assert f"trace {path} {shown}" in capsys.readouterr().out


def test_simulate_reports_a_bad_csv_row_on_one_line(tmp_path, capsys):
    path = write_text(tmp_path / "bad.csv", ["timestamp,session,block_ids", "0,a,0 x"])
    assert main(["simulate", str(path), "--capacity", "8", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "column 'block_ids[1]' must be an integer" in err
