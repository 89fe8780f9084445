"""Readers of other public trace formats, into the hash-id requests Mooncake's give.

Bailian (Alibaba's Qwen traces, ``qwen_traceA_blksz_16.jsonl`` ...; "KVCache Cache in the
Wild", ATC'25): ``{"chat_id", "parent_chat_id" (-1: a root), "timestamp" (seconds),
"input_length", "output_length", "type", "turn", "hash_ids"}``, one id per 16-token block,
the last one partial. Its ids are salted hashes of each block, so they are re-numbered
along each request's chain: equal ids then mean equal prefixes, as in Mooncake's. A
request's session is the root of its ``parent_chat_id`` chain (a parent not seen in the
file is taken as the root).

CSV (ours, documented in docs/simulator.md): a header naming ``timestamp`` (ms),
``session`` and ``block_ids`` (space-separated, prefix-chained ids), and optionally
``tenant``, ``input_length``, ``output_length``; ``block_size`` tokens per id.

``detect_format`` tells every format (ours and Mooncake's too) from a trace's first line.
Errors name the file, the line and the field (the column, for CSV). No prompt content.
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from pathlib import Path

from prefixcache.sim.traces import (
    CSV_COLUMNS,
    MAX_SESSION_CHARS,
    Fields,
    MooncakeRequest,
    check_blocks,
    check_chaining,
    line_error,
    parse_lines,
)

BAILIAN_BLOCK_TOKENS = 16
CSV_REQUIRED = CSV_COLUMNS[:3]  # timestamp, session, block_ids


class _Chains:
    """Re-numbers block ids along each chain: (id before, id) -> a new id, prefix-chained."""

    def __init__(self) -> None:
        self.ids: dict[tuple[int, int], int] = {}

    def chain(self, raw: list[int]) -> list[int]:
        parent, chained = -1, []
        for block_id in raw:
            parent = self.ids.setdefault((parent, block_id), len(self.ids))
            chained.append(parent)
        return chained


def detect_format(path: str | Path) -> str:
    """The format of the first non-blank line: a JSON object's fields ("bailian" has a
    ``chat_id``), or a CSV header naming one of our CSV columns ("csv")."""
    path = Path(path)
    with open(path, encoding="utf-8-sig") as handle:
        line_no, line = next(((n, t) for n, t in enumerate(handle, 1) if t.strip()), (0, ""))
    if not line:
        raise ValueError(f"{path}: the trace is empty")
    if not line.lstrip().startswith("{"):
        if {name.strip() for name in line.split(",")} & set(CSV_COLUMNS):
            return "csv"
        raise line_error(path, line_no, "neither a JSON object nor a CSV header naming "
                     "timestamp, session and block_ids")  # fmt: skip
    _, record = next(parse_lines(path))
    if "hash_ids" in record:
        return "bailian" if "chat_id" in record else "mooncake"
    if "token_ids" in record:
        return "tokens"
    raise line_error(path, line_no, "neither 'hash_ids' (Mooncake) nor 'token_ids' present")


def read_bailian(path: str | Path) -> Iterator[MooncakeRequest]:
    """Stream a Bailian trace: 16-token blocks, seconds -> ms, sessions from the chat chain."""
    path = Path(path)
    root_of: dict[int, int] = {}  # chat id -> the root of its chain
    chains = _Chains()
    for line_no, record in parse_lines(path):
        fields = Fields(path, line_no, record)
        chat, parent = _chat_id(fields, "chat_id", 0), _chat_id(fields, "parent_chat_id", -1)
        _turn(fields)
        fields.optional_str("type")
        request = MooncakeRequest(
            fields.timestamp("s") * 1000,
            fields.count("input_length"),
            fields.count("output_length"),
            fields.ids("hash_ids"),
            id_tokens=BAILIAN_BLOCK_TOKENS,
        )
        check_blocks(fields, request)
        request.hash_ids = chains.chain(request.hash_ids)
        root = chat if parent < 0 else root_of.get(parent, parent)
        root_of[chat] = root
        request.session = str(root)
        yield request


def _chat_id(fields: Fields, name: str, lowest: int) -> int:
    """An integer chat id >= ``lowest`` (``parent_chat_id`` -1: none)."""
    value = fields.required(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < lowest:
        raise fields.fail(name, f"must be an integer >= {lowest}, got {value!r}")
    return value


def _turn(fields: Fields) -> None:
    """``turn``, if present: the conversation's turn number, an integer >= 1."""
    if fields.record.get("turn") is not None and fields.count("turn") < 1:
        raise fields.fail("turn", f"must be >= 1, got {fields.record['turn']}")


def read_csv(path: str | Path, block_size: int) -> Iterator[MooncakeRequest]:
    """Stream our CSV: one request per row, ``block_size`` tokens per id, the last partial."""
    path = Path(path)
    parent_of: dict[int, int] = {}
    with open(path, encoding="utf-8-sig", newline="") as handle:
        rows = csv.reader(handle)
        header: list[str] | None = None
        for row in rows:
            if not any(cell.strip() for cell in row):
                continue
            if header is None:
                header = _header(path, rows.line_num, row)
                continue
            fields = _csv_fields(path, rows.line_num, header, row)
            ids = fields.ids("block_ids")
            default_length = len(ids) * block_size
            request = MooncakeRequest(
                fields.timestamp(),
                fields.count("input_length") if "input_length" in fields.record else default_length,
                fields.count("output_length") if "output_length" in fields.record else 0,
                ids,
                id_tokens=block_size,
                tenant=fields.optional_str("tenant"),
                session=fields.optional_str("session"),
            )
            check_blocks(fields, request, "block_ids")
            check_chaining(fields, ids, parent_of, "block_ids")
            yield request


def _header(path: Path, line_no: int, row: list[str]) -> list[str]:
    """The column names: the required ones present, none unknown or repeated."""
    names = [cell.strip() for cell in row]
    for name in names:
        if name not in CSV_COLUMNS:
            raise line_error(path, line_no, f"column {name!r} is not one of {list(CSV_COLUMNS)}")
        if names.count(name) > 1:
            raise line_error(path, line_no, f"column {name!r} appears twice in the header")
    for name in CSV_REQUIRED:
        if name not in names:
            raise line_error(path, line_no, f"column {name!r} is missing from the header")
    return names


def _csv_fields(path: Path, line_no: int, header: list[str], row: list[str]) -> Fields:
    """The row's cells as typed fields (empty optional cells left out)."""
    if len(row) != len(header):
        raise line_error(path, line_no, f"has {len(row)} columns, the header {len(header)}")
    fields = Fields(path, line_no, {}, noun="column")
    for name, cell in zip(header, row, strict=True):
        text = cell.strip()
        if text or name in CSV_REQUIRED:
            fields.record[name] = _cell(fields, name, text)
    return fields


def _cell(fields: Fields, name: str, text: str) -> object:
    """One cell parsed: numbers, a list of ids, or a string (an empty session: None)."""
    if name == "block_ids":
        return [_number(fields, f"{name}[{k}]", item, int) for k, item in enumerate(text.split())]
    if name == "timestamp":
        return _number(fields, name, text, float)
    if name in ("input_length", "output_length"):
        return _number(fields, name, text, int)
    if name == "session" and len(text) > MAX_SESSION_CHARS:
        raise fields.fail(name, f"has {len(text)} characters, more than {MAX_SESSION_CHARS}")
    return text or None


def _number(fields: Fields, name: str, text: str, kind: type) -> int | float:
    try:
        return kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise fields.fail(name, f"must be {what}, got {text!r}") from None
