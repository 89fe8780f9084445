"""Trace readers: the Mooncake block-hash format and our own token-id format (JSON lines).

Both read line by line and yield one validated request at a time. A malformed line raises
ValueError naming the file, the line number and the field. Token ids only, never text.

Mooncake (FAST'25 release): ``{"timestamp": ms, "input_length": n, "output_length": m,
"hash_ids": [...]}``, one id per 512-token block of the input, prefix-chained (an id at
position k stands for the same first k+1 blocks everywhere), the last block partial.

Ours: ``{"timestamp": ms, "token_ids": [...], "output_token_ids": [...],
"cache_salt": "...", "tenant": "..."}``; the last three are optional.

Both may carry ``"session": "..."`` (a conversation's id, a string of at most 256
characters or an integer; Mooncake also takes ``"session_id"``, as NVIDIA's tools write it).
Alibaba's Bailian traces and our CSV are read (``sim/trace_formats.py``) into the same
hash-id requests, 16 tokens per id. A trace without tenants (Mooncake's) can be split into
K of them by a hash of each request's first block (``split_tenants``): requests that share
a first block share a tenant, as a shared system prompt would.

Both formats may carry, as ``--trace-out`` writes them, ``"cache_key": id`` (an opaque
integer per tenant and ``prompt_cache_key``) and ``"retention": [[num_tokens, ttl_seconds],
...]`` (the request's retention marks: keep its first ``num_tokens`` cached that long).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

from prefixcache.cache.common import DEFAULT_BLOCK_SIZE

MOONCAKE_BLOCK_TOKENS = 512
MAX_ID = 2**32 - 1
MAX_SESSION_CHARS = 256
TOKEN_FIELDS = {
    "timestamp", "token_ids", "output_token_ids", "cache_salt", "tenant", "cache_key", "retention",
    "session",
}  # fmt: skip
TRACE_FORMATS = ("auto", "mooncake", "tokens", "bailian", "csv")
CSV_COLUMNS = ("timestamp", "session", "block_ids", "tenant", "input_length", "output_length")


class Mark(NamedTuple):
    """A retention mark: keep the prompt's first ``num_tokens`` cached ``ttl_seconds``."""

    num_tokens: int
    ttl_seconds: float


@dataclass(slots=True)
class MooncakeRequest:
    """One Mooncake request: its input blocks as prefix-chained hash ids."""

    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]
    block_size: int | None = None  # set by `--trace-out`: ids of full blocks of this size
    tenant: str | None = None  # set by ``split_tenants``
    cache_key: int | None = None
    retention: list[Mark] = field(default_factory=list)
    id_tokens: int = MOONCAKE_BLOCK_TOKENS  # tokens per id without block_size, the last partial
    session: str | None = None

    def usable_hits(self, hit_blocks: int) -> int:
        """Hit blocks a server would serve: rule 10's cap applies to captured traces."""
        if self.block_size is None:
            return hit_blocks
        return min(hit_blocks, (self.input_length - 1) // self.block_size)

    def hit_tokens(self, hit_blocks: int) -> int:
        """Tokens in the first ``hit_blocks`` blocks: ``id_tokens`` each, the last partial."""
        if self.block_size is not None:
            return self.usable_hits(hit_blocks) * self.block_size
        if hit_blocks >= len(self.hash_ids):
            return self.input_length
        return hit_blocks * self.id_tokens


@dataclass(slots=True)
class TokenRequest:
    """One request of our own format: prompt and output token ids, salt and tenant."""

    timestamp: float
    token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    cache_salt: str | None = None
    tenant: str | None = None
    cache_key: int | None = None
    retention: list[Mark] = field(default_factory=list)
    session: str | None = None


@dataclass(slots=True)
class Trace:
    """A loaded trace: where it came from, how it replays, and its requests in time order."""

    path: str
    kind: str  # "mooncake" (hash-id requests) or "tokens"
    requests: list
    source_format: str = ""  # the file's format when it is not ``kind``: "bailian", "csv"

    @property
    def format_name(self) -> str:
        """The format the trace was read from."""
        return self.source_format or self.kind


class LineError(ValueError):
    """A malformed trace line (the message names the file, the line and the field)."""


def line_error(path: Path, line_no: int, message: str) -> LineError:
    """A trace error naming the file and line (every trace reader's)."""
    return LineError(f"{path}, line {line_no}: {message}")


def parse_lines(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, JSON object) for every non-blank line, streaming."""
    with open(path, encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise line_error(path, line_no, f"invalid JSON ({error.msg})") from None
            if not isinstance(record, dict):
                raise line_error(
                    path, line_no, f"expected a JSON object, got {type(record).__name__}"
                )
            yield line_no, record


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class Fields:
    """Typed access to one record's fields; every failure names the field."""

    def __init__(self, path: Path, line_no: int, record: dict, noun: str = "field") -> None:
        self.path, self.line_no, self.record, self.noun = path, line_no, record, noun

    def fail(self, name: str, message: str) -> LineError:
        return line_error(self.path, self.line_no, f"{self.noun} {name!r} {message}")

    def required(self, name: str) -> object:
        if name not in self.record:
            raise self.fail(name, "is missing")
        return self.record[name]

    def timestamp(self, unit: str = "ms") -> float:
        value = self.required("timestamp")
        if not (_is_int(value) or isinstance(value, float)) or not math.isfinite(value):
            raise self.fail("timestamp", f"must be a number ({unit}), got {value!r}")
        if value < 0:
            raise self.fail("timestamp", f"must be >= 0, got {value}")
        return value

    def count(self, name: str) -> int:
        value = self.required(name)
        if not _is_int(value):
            raise self.fail(name, f"must be an integer, got {type(value).__name__}")
        if value < 0:
            raise self.fail(name, f"must be >= 0, got {value}")
        return value

    def ids(self, name: str, *, required: bool = True) -> list[int]:
        """A list of ids in [0, 2**32); non-empty when required."""
        value = self.required(name) if required else self.record.get(name, [])
        if not isinstance(value, list):
            raise self.fail(name, f"must be a list of integers, got {type(value).__name__}")
        if required and not value:
            raise self.fail(name, "is empty")
        for position, item in enumerate(value):
            if not _is_int(item) or not 0 <= item <= MAX_ID:
                raise self.fail(name, f"[{position}] = {item!r} is not an integer in [0, 2**32)")
        return value

    def cache_key(self) -> int | None:
        """``cache_key``: an opaque id, an integer >= 0, or absent."""
        return self.count("cache_key") if self.record.get("cache_key") is not None else None

    def retention(self, input_length: int) -> list[Mark]:
        """``retention``: ``[[num_tokens, ttl_seconds], ...]``, tokens in [1, input_length],
        the TTL a finite number > 0 (seconds)."""
        value = self.record.get("retention")
        if value is None:
            return []
        if not isinstance(value, list):
            raise self.fail(
                "retention", f"must be a list of [num_tokens, ttl_seconds], got {value!r}"
            )
        return [self._mark(position, item, input_length) for position, item in enumerate(value)]

    def _mark(self, position: int, item: object, input_length: int) -> Mark:
        name = f"retention[{position}]"
        if not isinstance(item, list) or len(item) != 2:
            raise self.fail(name, f"must be [num_tokens, ttl_seconds], got {item!r}")
        tokens, ttl = item
        if not _is_int(tokens) or not 1 <= tokens <= input_length:
            raise self.fail(
                name, f"num_tokens must be an integer in [1, {input_length}], got {tokens!r}"
            )
        number = _is_int(ttl) or isinstance(ttl, float)
        if not number or not math.isfinite(ttl) or ttl <= 0:
            raise self.fail(name, f"ttl_seconds must be a finite number > 0, got {ttl!r}")
        return Mark(tokens, float(ttl))

    def optional_str(self, name: str) -> str | None:
        value = self.record.get(name)
        if value is not None and not isinstance(value, str):
            raise self.fail(name, f"must be a string, got {type(value).__name__}")
        return value

    def session(self, *names: str) -> str | None:
        """The first of ``names`` present: a string of at most 256 characters, or an integer."""
        name = next((n for n in names if self.record.get(n) is not None), None)
        if name is None:
            return None
        value = self.record[name]
        if _is_int(value):
            return str(value)
        if not isinstance(value, str):
            raise self.fail(name, f"must be a string or an integer, got {type(value).__name__}")
        if len(value) > MAX_SESSION_CHARS:
            raise self.fail(name, f"has {len(value)} characters, more than {MAX_SESSION_CHARS}")
        return value


def read_mooncake(path: str | Path) -> Iterator[MooncakeRequest]:
    """Stream a Mooncake trace, checking lengths against the ids and the prefix chaining."""
    path = Path(path)
    parent_of: dict[int, int] = {}  # id -> the id before it (-1 at position 0)
    for line_no, record in parse_lines(path):
        fields = Fields(path, line_no, record)
        request = MooncakeRequest(
            fields.timestamp(),
            fields.count("input_length"),
            fields.count("output_length"),
            fields.ids("hash_ids", required=False),
            _optional_block_size(fields),
        )
        check_blocks(fields, request)
        check_chaining(fields, request.hash_ids, parent_of)
        request.cache_key = fields.cache_key()
        request.retention = fields.retention(request.input_length)
        request.session = fields.session("session", "session_id")
        yield request


def _optional_block_size(fields: Fields) -> int | None:
    """``block_size`` (captured traces): tokens per block, a positive integer."""
    if "block_size" not in fields.record:
        return None
    size = fields.count("block_size")
    if size < 1:
        raise fields.fail("block_size", f"must be >= 1, got {size}")
    return size


def check_blocks(fields: Fields, request: MooncakeRequest, name: str = "hash_ids") -> None:
    """The ids cover the input: one per ``id_tokens`` (512: Mooncake), the last one partial,
    or one per full block of ``block_size`` tokens (captured by ``--trace-out``)."""
    if request.block_size is None:
        needed = math.ceil(request.input_length / request.id_tokens)
        what = f"blocks of {request.id_tokens}"
    else:
        needed = request.input_length // request.block_size
        what = f"full blocks of block_size {request.block_size}"
    if needed != len(request.hash_ids):
        raise fields.fail(
            name,
            f"has {len(request.hash_ids)} ids but input_length {request.input_length} "
            f"needs {needed} {what}",
        )
    if request.block_size is None and not request.hash_ids:
        raise fields.fail(name, "is empty")


def check_chaining(
    fields: Fields, hash_ids: list[int], parent_of: dict[int, int], name: str = "hash_ids"
) -> None:
    """An id must follow the same id everywhere (and never repeat within a request)."""
    parent = -1
    for position, block_id in enumerate(hash_ids):
        known = parent_of.setdefault(block_id, parent)
        if known != parent:
            raise fields.fail(
                name,
                f"[{position}] = {block_id} follows {parent} here but {known} earlier: "
                "ids must be prefix-chained",
            )
        parent = block_id


def read_token_trace(path: str | Path) -> Iterator[TokenRequest]:
    """Stream a trace of our own token-id format."""
    path = Path(path)
    for line_no, record in parse_lines(path):
        fields = Fields(path, line_no, record)
        unknown = sorted(set(record) - TOKEN_FIELDS)
        if unknown:
            raise fields.fail(unknown[0], f"is not one of {sorted(TOKEN_FIELDS)}")
        tokens = fields.ids("token_ids")
        yield TokenRequest(
            fields.timestamp(),
            tokens,
            fields.ids("output_token_ids", required=False),
            fields.optional_str("cache_salt"),
            fields.optional_str("tenant"),
            fields.cache_key(),
            fields.retention(len(tokens)),
            fields.session("session"),
        )


def split_tenants(trace: Trace, count: int, block_size: int) -> Trace:
    """The trace with each request's tenant set to ``t<k>``, k a hash of its first block.

    Mooncake: the first hash id; ours: the salt and the first ``block_size`` token ids.
    """
    if count < 1:
        raise ValueError(f"--tenants must be >= 1, got {count}")

    def tenant(request: MooncakeRequest | TokenRequest) -> str:
        if isinstance(request, MooncakeRequest):
            first: object = request.hash_ids[:1]
        else:
            first = [request.cache_salt, request.token_ids[:block_size]]
        digest = hashlib.blake2b(json.dumps(first).encode(), digest_size=8).digest()
        return f"t{int.from_bytes(digest, 'little') % count}"

    return replace(trace, requests=[replace(r, tenant=tenant(r)) for r in trace.requests])


def load_trace(
    path: str | Path, trace_format: str = "auto", block_size: int = DEFAULT_BLOCK_SIZE
) -> Trace:
    """Read a whole trace once (validated), in timestamp order (stable for ties).

    ``block_size``: tokens per block id of a CSV trace (the other formats fix their own)."""
    from prefixcache.sim import trace_formats

    kind = trace_formats.detect_format(path) if trace_format == "auto" else trace_format
    readers = {
        "mooncake": read_mooncake,
        "tokens": read_token_trace,
        "bailian": trace_formats.read_bailian,
        "csv": lambda csv_path: trace_formats.read_csv(csv_path, block_size),
    }
    if kind not in readers:
        raise ValueError(f"unknown trace format {kind!r}; choose one of {', '.join(TRACE_FORMATS)}")
    requests = list(readers[kind](path))
    if any(a.timestamp > b.timestamp for a, b in itertools.pairwise(requests)):
        requests.sort(key=lambda request: request.timestamp)
    if kind == "tokens":
        return Trace(str(path), kind, requests)
    return Trace(str(path), "mooncake", requests, "" if kind == "mooncake" else kind)
