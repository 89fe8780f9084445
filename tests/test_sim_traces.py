"""Trace readers: good lines of both formats, and each kind of bad line with its message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import REAL_TRACE
from prefixcache.sim.trace_formats import detect_format
from prefixcache.sim.traces import (
    MooncakeRequest,
    TokenRequest,
    load_trace,
    read_mooncake,
    read_token_trace,
)


def write_lines(path: Path, lines: list[object]) -> Path:
    """One line per item: dicts as JSON, strings verbatim."""
    text = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines)
    path.write_text(text + "\n", encoding="utf-8")
    return path


def mooncake(timestamp=0, input_length=1000, output_length=5, hash_ids=(0, 1)) -> dict:
    return {
        "timestamp": timestamp,
        "input_length": input_length,
        "output_length": output_length,
        "hash_ids": list(hash_ids),
    }


def test_mooncake_lines_are_read_in_order_with_partial_last_block(tmp_path):
    path = write_lines(
        tmp_path / "t.jsonl",
        [mooncake(0, 1000, 3, [0, 1]), "", mooncake(40.5, 1536, 0, [0, 1, 2])],
    )
    requests = list(read_mooncake(path))
    assert requests == [
        MooncakeRequest(0, 1000, 3, [0, 1]),
        MooncakeRequest(40.5, 1536, 0, [0, 1, 2]),
    ]
    assert requests[0].hit_tokens(1) == 512
    assert requests[0].hit_tokens(2) == 1000  # the partial block counts its real tokens
    assert detect_format(path) == "mooncake"


def test_token_lines_with_optional_fields(tmp_path):
    path = write_lines(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 5, "token_ids": [1, 2, 3]},
            {
                "timestamp": 7,
                "token_ids": [1, 2],
                "output_token_ids": [9],
                "cache_salt": "s",
                "tenant": "acme",
            },
        ],
    )
    assert list(read_token_trace(path)) == [
        TokenRequest(5, [1, 2, 3]),
        TokenRequest(7, [1, 2], [9], "s", "acme"),
    ]
    assert detect_format(path) == "tokens"


def test_load_trace_sorts_by_timestamp_stably(tmp_path):
    path = write_lines(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 9, "token_ids": [1]},
            {"timestamp": 3, "token_ids": [2]},
            {"timestamp": 9, "token_ids": [3]},
            {"timestamp": 3, "token_ids": [4]},
        ],
    )
    trace = load_trace(path)
    assert trace.kind == "tokens"
    assert [r.token_ids[0] for r in trace.requests] == [2, 4, 1, 3]


def test_reading_streams_line_by_line(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [mooncake(), "{not json"])
    reader = read_mooncake(path)
    assert next(reader).hash_ids == [0, 1]  # the bad line 2 is not read yet
    with pytest.raises(ValueError, match="line 2"):
        next(reader)


MOONCAKE_ERRORS = [
    ("{oops", r"line 1: invalid JSON"),
    ("[1, 2]", r"line 1: expected a JSON object, got list"),
    ({"input_length": 1, "output_length": 0, "hash_ids": [0]}, r"'timestamp' is missing"),
    (mooncake(timestamp="0"), r"'timestamp' must be a number \(ms\), got '0'"),
    (mooncake(timestamp=-1), r"'timestamp' must be >= 0, got -1"),
    (mooncake(input_length=-5), r"'input_length' must be >= 0, got -5"),
    (mooncake(input_length=1.5), r"'input_length' must be an integer, got float"),
    (mooncake(output_length=True), r"'output_length' must be an integer, got bool"),
    ({"timestamp": 0, "input_length": 1, "hash_ids": [0]}, r"'output_length' is missing"),
    (mooncake(input_length=0, hash_ids=[]), r"'hash_ids' is empty"),
    ({**mooncake(), "hash_ids": "0,1"}, r"'hash_ids' must be a list of integers, got str"),
    (mooncake(hash_ids=[0, -1]), r"'hash_ids' \[1\] = -1 is not an integer in \[0, 2\*\*32\)"),
    (mooncake(hash_ids=[0, 2**32]), r"'hash_ids' \[1\] = 4294967296 is not an integer"),
    (mooncake(input_length=1025), r"'hash_ids' has 2 ids but input_length 1025 needs 3 blocks"),
]


@pytest.mark.parametrize(("line", "message"), MOONCAKE_ERRORS)
def test_each_bad_mooncake_line_names_file_line_and_field(tmp_path, line, message):
    path = write_lines(tmp_path / "bad.jsonl", [line])
    with pytest.raises(ValueError, match=message) as error:
        list(read_mooncake(path))
    assert str(error.value).startswith(f"{path}, line 1: ")


def test_mooncake_ids_must_be_prefix_chained(tmp_path):
    path = write_lines(
        tmp_path / "bad.jsonl", [mooncake(hash_ids=[0, 1]), mooncake(hash_ids=[2, 1])]
    )
    with pytest.raises(ValueError, match=r"line 2: field 'hash_ids' \[1\] = 1 follows 2 here"):
        list(read_mooncake(path))


TOKEN_ERRORS = [
    ({"token_ids": [1]}, r"'timestamp' is missing"),
    ({"timestamp": 0}, r"'token_ids' is missing"),
    ({"timestamp": 0, "token_ids": []}, r"'token_ids' is empty"),
    ({"timestamp": 0, "token_ids": [1, "2"]}, r"'token_ids' \[1\] = '2' is not an integer"),
    ({"timestamp": 0, "token_ids": [1], "output_token_ids": 3}, r"'output_token_ids' must be"),
    ({"timestamp": 0, "token_ids": [1], "cache_salt": 7}, r"'cache_salt' must be a string, got"),
    ({"timestamp": 0, "token_ids": [1], "tenant": ["a"]}, r"'tenant' must be a string, got list"),
    ({"timestamp": 0, "token_ids": [1], "text": "hi"}, r"field 'text' is not one of"),
    ({"timestamp": float("nan"), "token_ids": [1]}, r"'timestamp' must be a number"),
]


@pytest.mark.parametrize(("record", "message"), TOKEN_ERRORS)
def test_each_bad_token_line_names_file_line_and_field(tmp_path, record, message):
    path = write_lines(tmp_path / "bad.jsonl", [{"timestamp": 0, "token_ids": [5]}, record])
    with pytest.raises(ValueError, match=message) as error:
        list(read_token_trace(path))
    assert str(error.value).startswith(f"{path}, line 2: ")


def test_unknown_or_empty_traces_are_refused(tmp_path):
    empty = write_lines(tmp_path / "empty.jsonl", [""])
    with pytest.raises(ValueError, match="the trace is empty"):
        load_trace(empty)
    other = write_lines(tmp_path / "other.jsonl", [{"timestamp": 0, "prompt": "hi"}])
    with pytest.raises(ValueError, match="line 1: neither 'hash_ids'"):
        load_trace(other)
    with pytest.raises(ValueError, match="unknown trace format 'parquet'"):
        load_trace(other, "parquet")


def test_the_real_trace_reads_clean():
    trace = load_trace(REAL_TRACE)
    assert trace.kind == "mooncake"
    assert len(trace.requests) == 3993
    assert sum(len(r.hash_ids) for r in trace.requests) == 121_877
