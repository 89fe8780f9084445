"""Replay a trace through the real ``KVCacheManager``, one request after another.

Mooncake traces: each 512-token block is one cache block (``block_size=1``, token id = the
block's hash id: the ids are prefix-chained, so the manager's chain keys identify exactly
the same prefixes). A request looks up its blocks without rule 10's cap (no logits are
needed), all its blocks are then cached (the last, partial one too) and it is freed.
Outputs are not cached: the ids cover the input only.

Our token-id format replays with the engine's rules: the cap is on, the prompt is
committed, the output tokens are appended and committed, then the request is freed.

With a ``KVModel`` (``sim/kv_model.py``) the pool has its window groups: ``capacity`` blocks
every layer holds become ``capacity x pages_per_block`` pages, a prompt is committed whole,
so its pages out of the window go back at once (relative to the committed length), and the
result has the window counters and the KV bytes per cached token by group. Windows need
token ids: a Mooncake id stands for a whole block of unknown tokens, so it is refused.

With ``owner_shares`` the pool is tenant-fair and each request's tenant is its owner.

Retention: the cache's clock follows the trace's timestamps (ms -> s), and after a request's
prompt is cached its retention marks are applied with ``retain`` (its tenant the owner):
the trace's own, or, with a ``RetentionModel`` TTL, one mark over every whole prompt (or
over its first ``prefix_blocks`` blocks).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from prefixcache.cache import KVCacheManager
from prefixcache.cache.common import DEFAULT_BLOCK_SIZE, cdiv
from prefixcache.cache.retention import DEFAULT_SHARE
from prefixcache.cache.sequence import Sequence
from prefixcache.progress import Progress
from prefixcache.shutdown import raise_if_stop_requested
from prefixcache.sim.kv_model import KVModel
from prefixcache.sim.traces import (
    MOONCAKE_BLOCK_TOKENS,
    Mark,
    MooncakeRequest,
    TokenRequest,
    Trace,
)

IN_MEMORY_SECONDS = 300.0  # OpenAI's "in_memory" retention; a longer TTL is the "24h" class


@dataclass(frozen=True, slots=True)
class RetentionModel:
    """How a replay retains: ``ttl_seconds`` marks every whole prompt, or its first
    ``prefix_blocks`` blocks (None: the trace's own marks; 0: no retention at all);
    ``budget`` is each owner's share of the pool."""

    ttl_seconds: float | None = None
    budget: float = DEFAULT_SHARE
    prefix_blocks: int | None = None

    def marks(self, request: MooncakeRequest | TokenRequest, length: int, block: int) -> list[Mark]:
        """The marks for a cached prompt of ``length`` tokens, ``block`` tokens per block."""
        if self.ttl_seconds is None:
            return request.retention
        if self.ttl_seconds <= 0:
            return []
        if self.prefix_blocks is not None:
            length = min(length, self.prefix_blocks * block)
        return [Mark(length, self.ttl_seconds)]


@dataclass(slots=True)
class ReplayResult:
    """What one replay at one capacity with one policy and one index measured."""

    capacity: int
    policy: str
    index: str
    requests: int = 0
    blocks: int = 0  # block lookups (all blocks of each request; prompt blocks for tokens)
    hit_blocks: int = 0
    tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0
    evictions: int = 0
    retention_ttl: float | None = None  # the model's TTL (None: the trace's marks)
    retention_budget: float = DEFAULT_SHARE
    retention_prefix_blocks: int | None = None  # the model's prefix (None: whole prompts)
    retained_blocks: int = 0  # blocks retain() marked (summed over requests)
    retention_refused: int = 0
    retention_expired: int = 0
    retention_evictions: int = 0
    retention_saved_hits: int = 0
    peak_usage: float = 0.0  # largest share of the pool held by live requests
    peak_cached_blocks: int = 0  # most blocks indexed at once
    wall_seconds: float = 0.0
    tenants: dict[str, list[int]] = field(default_factory=dict)  # tenant -> [tokens, hits]
    fair: bool = False  # replayed through a tenant-fair pool (owner shares)
    layout: str = ""  # the KVModel's layout ("": none modelled)
    pages: int = 0  # pool pages (capacity x pages per block)
    kv_bytes: int = 0  # the pool's bytes (0: token size unknown)
    kv_cache_dtype: str = ""
    window_pages_released: int = 0
    window_pages_evicted: int = 0
    window_lost_tokens: int = 0
    bytes_per_cached_token: dict[str, float] = field(default_factory=dict)  # group -> bytes
    hits_per_request: list[int] = field(default_factory=list, repr=False)

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.tokens if self.tokens else 0.0

    @property
    def kv_bytes_per_cached_token(self) -> float:
        """Every group's bytes per cached token (0.0: token size unknown)."""
        return sum(self.bytes_per_cached_token.values())

    def as_dict(self) -> dict:
        """Every field but the per-request hits, plus both hit rates."""
        data = asdict(self)
        del data["hits_per_request"]
        for name in ("tenants", "bytes_per_cached_token"):
            if not data[name]:
                del data[name]
        return {
            **data,
            "block_hit_rate": self.block_hit_rate,
            "token_hit_rate": self.token_hit_rate,
            **(
                {"kv_bytes_per_cached_token": self.kv_bytes_per_cached_token} if self.layout else {}
            ),
        }


def replay(
    trace: Trace,
    capacity: int,
    policy: str = "lru",
    index: str = "hash",
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    progress: Progress | None = None,
    owner_shares: Mapping[str, float] | None = None,
    retention: RetentionModel | None = None,
    kv: KVModel | None = None,
) -> ReplayResult:
    """Replay ``trace`` at ``capacity`` blocks; ``block_size`` applies to token traces only.

    ``owner_shares`` (``{}``: equal) replays through a fair pool, tenants as owners.
    ``retention`` (default: the trace's marks, the default budget) says what is retained.
    ``kv`` (default: one full group, sizes unknown) gives the pool its layout.
    """
    check_capacity(trace, capacity, block_size)
    check_windows(trace, kv)
    size = 1 if trace.kind == "mooncake" else block_size
    retention = retention or RetentionModel()
    now = [0.0]  # the trace's clock, seconds
    manager = KVCacheManager(
        capacity * (kv.pages_per_block if kv else 1), size, eviction_policy=policy,
        index=index, owner_shares=owner_shares, clock=lambda: now[0],
        retention_budget=retention.budget, groups=kv.groups if kv else (),
    )  # fmt: skip
    result = ReplayResult(capacity, policy, index, fair=owner_shares is not None)
    result.retention_ttl, result.retention_budget = retention.ttl_seconds, retention.budget
    result.retention_prefix_blocks = retention.prefix_blocks
    step = _replay_mooncake if trace.kind == "mooncake" else _replay_tokens
    start = time.perf_counter()
    for number, request in enumerate(trace.requests):
        now[0] = request.timestamp / 1000
        step(manager, str(number), request, result, retention)
        cached = len(manager.pool.cached)
        if cached > result.peak_cached_blocks:
            result.peak_cached_blocks = cached
        if number % 256 == 255:
            raise_if_stop_requested()  # a Ctrl-C CPython dropped ends the replay all the same
            if progress is not None:
                progress(256)
    result.wall_seconds = time.perf_counter() - start
    if progress is not None:
        progress(len(trace.requests) % 256)
    _finish(result, manager)
    if kv is not None:
        _count_layout(result, manager, kv, block_tokens(trace, block_size))
    return result


def check_windows(trace: Trace, kv: KVModel | None) -> None:
    """ValueError for window groups on a hash-id trace: its ids stand for whole blocks."""
    if kv is not None and kv.windowed and trace.kind == "mooncake":
        raise ValueError(
            f"--window needs a trace of token ids: {trace.path} ({trace.format_name}) has "
            f"block hash ids, each standing for a whole block of tokens it does not give, "
            f"so a {kv.window}-token window cannot be placed in it (replay our token-id "
            "JSONL or a CSV, or use --kv-layout full)"
        )


def _count_layout(
    result: ReplayResult, manager: KVCacheManager, kv: KVModel, tokens_per_block: int
) -> None:
    """The layout's numbers: pages, bytes, window counters, bytes per cached token by group
    (of what the pool holds after the trace)."""
    stats = manager.stats
    result.layout, result.pages, result.kv_cache_dtype = kv.layout, manager.num_blocks, kv.dtype
    result.window_pages_released = stats.window_pages_released
    result.window_pages_evicted = stats.window_pages_evicted
    result.window_lost_tokens = stats.window_lost_tokens
    page_token = kv.page_token_bytes
    if page_token is None:
        return
    result.kv_bytes = manager.num_blocks * page_token * tokens_per_block
    result.bytes_per_cached_token = {"full": float(page_token)}
    if manager.windows is not None:
        cached = len(manager.pool.cached)
        per_group = manager.windows.bytes_per_cached_token(page_token, cached)
        for group, value in enumerate(per_group, 1):
            result.bytes_per_cached_token[f"window{group}"] = value


def _finish(result: ReplayResult, manager: KVCacheManager) -> None:
    """Copy the manager's counters into ``result``; the pool must be whole and consistent."""
    manager.check_invariants()
    assert manager.num_free_blocks == manager.num_blocks, "the replay leaked blocks"
    result.requests = manager.stats.requests
    result.evictions = manager.stats.evictions
    stats = manager.stats
    result.retention_refused, result.retention_expired = (
        stats.retention_refused,
        stats.retention_expired,
    )
    result.retention_evictions = stats.retention_evictions
    result.retention_saved_hits = stats.retention_saved_hits
    result.peak_usage = 1.0 - manager.stats.min_free_blocks / manager.num_blocks


def _retain(
    manager: KVCacheManager,
    seq: Sequence,
    request: MooncakeRequest | TokenRequest,
    retention: RetentionModel,
    result: ReplayResult,
) -> None:
    """Apply the request's marks to its cached ``seq`` (its tenant the owner).

    A Mooncake mark covers whole ids (``id_tokens``, or ``block_size`` for captured traces),
    the partial last one only when it covers the whole input."""
    if isinstance(request, MooncakeRequest):
        unit, length = request.block_size or request.id_tokens, request.input_length
    else:
        unit, length = 1, len(request.token_ids)
    for mark in retention.marks(request, length, unit * manager.block_size):
        tokens = seq.num_tokens if mark.num_tokens >= length else mark.num_tokens // unit
        klass = "5m" if mark.ttl_seconds <= IN_MEMORY_SECONDS else "24h"
        retained = manager.retain(seq, tokens, mark.ttl_seconds, klass, request.tenant)
        result.retained_blocks += retained


def _replay_mooncake(
    manager: KVCacheManager,
    request_id: str,
    request: MooncakeRequest,
    result: ReplayResult,
    retention: RetentionModel,
) -> None:
    """Look up every block (no cap), cache them all, free."""
    ids = request.hash_ids
    result.tokens += request.input_length
    if not ids:  # a captured request shorter than one block
        result.hits_per_request.append(0)
        _count_tenant(result, request.tenant, request.input_length, 0)
        return
    seq = manager.admit(request_id, ids, cap_last_token=False, owner=request.tenant)
    assert seq is not None, "a sequential replay always has the whole pool free"
    manager.commit(seq, len(ids))
    _retain(manager, seq, request, retention, result)
    manager.free(seq)
    hit = request.usable_hits(seq.num_cached_tokens)
    result.blocks += len(ids)
    result.hit_blocks += hit
    result.hit_tokens += request.hit_tokens(hit)
    result.hits_per_request.append(hit)
    _count_tenant(result, request.tenant, request.input_length, request.hit_tokens(hit))


def _replay_tokens(
    manager: KVCacheManager,
    request_id: str,
    request: TokenRequest,
    result: ReplayResult,
    retention: RetentionModel,
) -> None:
    """The engine's rules: capped lookup, prompt committed (and retained), outputs appended
    and committed."""
    prompt = request.token_ids
    seq = manager.admit(request_id, prompt, cache_salt=request.cache_salt, owner=request.tenant)
    assert seq is not None, "a sequential replay always has the whole pool free"
    manager.commit(seq, len(prompt))
    _retain(manager, seq, request, retention, result)
    outputs = request.output_token_ids
    free_blocks = manager.num_free_blocks // manager.pages_per_block
    room = (len(seq.blocks) + free_blocks) * manager.block_size - len(prompt)
    if outputs[:room] and manager.append(seq, outputs[:room]):
        manager.commit(seq, seq.num_tokens)
    manager.free(seq)
    hit = seq.num_cached_tokens
    result.blocks += cdiv(len(prompt), manager.block_size)
    result.hit_blocks += hit // manager.block_size
    result.tokens += len(prompt)
    result.hit_tokens += hit
    result.hits_per_request.append(hit // manager.block_size)
    _count_tenant(result, request.tenant, len(prompt), hit)


def _count_tenant(result: ReplayResult, tenant: str | None, tokens: int, hits: int) -> None:
    """Per-tenant prompt tokens and hit tokens (requests without a tenant are not counted)."""
    if tenant is not None:
        counts = result.tenants.setdefault(tenant, [0, 0])
        counts[0] += tokens
        counts[1] += hits


def block_tokens(trace: Trace, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Tokens one cache block stands for: ``block_size``, or a hash-id trace's tokens per id
    (512 for Mooncake's, 16 for Bailian's)."""
    if trace.kind != "mooncake":
        return block_size
    first = trace.requests[0] if trace.requests else None
    return (first.block_size or first.id_tokens) if first else MOONCAKE_BLOCK_TOKENS


def largest_request(trace: Trace, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """The most blocks one prompt needs."""
    if trace.kind == "mooncake":
        return max((len(r.hash_ids) for r in trace.requests), default=0)
    return max((cdiv(len(r.token_ids), block_size) for r in trace.requests), default=0)


def check_capacity(trace: Trace, capacity: int, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
    """ValueError unless every prompt fits in ``capacity`` blocks."""
    largest = largest_request(trace, block_size)
    if capacity < max(largest, 1):
        raise ValueError(f"capacity {capacity} is below the largest request ({largest} blocks)")


def block_references(
    trace: Trace, capacity: int, block_size: int = DEFAULT_BLOCK_SIZE
) -> list[list[int]]:
    """Each request's cached blocks as prefix-chained ids: the input of the optimum.

    Mooncake: the hash ids themselves. Token traces: an id per full block of prompt and
    kept output, chained like the manager's keys (salt at the root), so equal ids mean
    equal prefixes; outputs are cut where the replay cuts them (the pool is full).
    """
    if trace.kind == "mooncake":
        return [request.hash_ids for request in trace.requests]
    ids: dict[tuple, int] = {}
    references = []
    for request in trace.requests:
        limit = max(len(request.token_ids), capacity * block_size)
        tokens = (request.token_ids + request.output_token_ids)[:limit]
        parent: object = ("root", request.cache_salt)
        chain = []
        for start in range(0, len(tokens) - block_size + 1, block_size):
            key = (parent, tuple(tokens[start : start + block_size]))
            parent = ids.setdefault(key, len(ids))
            chain.append(parent)
        references.append(chain)
    return references
