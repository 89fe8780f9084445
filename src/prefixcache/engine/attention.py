"""Paged attention on CPU: each sequence's new queries attend to its whole context in blocks.

A step's batch is flattened: sequence i contributes its last `query_lens[i]` positions out
of `context_lens[i]`. Decode rows (query length 1) share one padded gather and one masked
SDPA call; each prefill or chunk gets its own SDPA call with an offset causal mask.

Cascade attention: sequences whose block tables start with the same physical blocks (a
shared, already-computed prefix) gather that prefix once. All their query rows attend to
it in one call, then each row attends to its own remaining keys, and the two partial
results are merged exactly by their log-sum-exps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, pairwise

import torch
import torch.nn.functional as F

from prefixcache.cache.common import cdiv
from prefixcache.engine import kernels
from prefixcache.engine.kv_quant import dequantize_int8

NATIVE_GATHER = (torch.bfloat16, torch.uint8)  # pools `kernels/kv_rows.cpp` reads in one pass

# When a cascade group pays (see `benchmarks/attention.py --threshold`): a group costs a
# roughly fixed extra attention call and merge per layer, and saves gathering its shared
# blocks again for every member but one. So a group needs enough saved tokens,
# (members - 1) * shared tokens, besides a few shared blocks.
MIN_SHARED_BLOCKS = 2
MIN_SAVED_TOKENS = 1024
# A chunk of at least this many new tokens after computed ones attends in two parts (its
# prefix unmasked, its own tokens causally, merged by log-sum-exp) instead of under one
# explicit mask, which takes torch's slower masked kernel: 1,776 new tokens after 224 took
# 68 against 42 ms a layer here; under ~512 the two cost the same.
MIN_SPLIT_QUERIES = 512

Rows = torch.Tensor | slice


@dataclass(frozen=True, slots=True)
class PrefillSeq:
    """One sequence with several new tokens: rows `start:start + query_len` of the batch.

    It attends to context positions `[key_start, context_len)`; `key_start > 0` only for a
    member of a shared-prefix group, whose shared part is attended separately.
    """

    start: int
    query_len: int
    context_len: int
    block_ids: torch.Tensor  # physical blocks holding positions key_start.., in order
    mask: torch.Tensor | None  # [query_len, context_len - key_start] bool; None: causal on new
    key_start: int = 0
    bias: torch.Tensor | None = None  # the mask as fp32 0/-inf, for group members
    prefix_keys: int = 0  # > 0: keys every query sees, then causal on the new ones (split)


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    """All sequences with one new token, attended together over padded block tables."""

    rows: Rows  # their rows in the flattened batch
    num_seqs: int
    block_ids: torch.Tensor  # [num_seqs * max_blocks] padded block tables, flattened
    mask: torch.Tensor  # [num_seqs, 1, 1, max_blocks * block_size] bool, True = attend
    bias: torch.Tensor | None = None  # the mask as fp32 0/-inf, for group members
    num_keys: int = 0  # keys of the longest sequence (a lone one needs no mask: it is cut)
    window: int = 0  # a sliding-window layer's span: a row sees only its last `window` keys


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """Sequences whose first `num_tokens` context positions live in the same physical blocks.

    The prefix lies before every new query position of the group, so it needs no mask.
    """

    seqs: tuple[int, ...]  # indices of the member sequences in the batch
    rows: Rows  # all their query rows in the flattened batch
    block_ids: torch.Tensor  # [num_tokens // block_size] the shared blocks
    num_tokens: int


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """How paged attention runs a batch: its decode rows, prefills and cascade groups."""

    decode: DecodeBatch | None  # decode rows outside every shared-prefix group
    prefills: tuple[PrefillSeq, ...]
    shared_prefixes: tuple[SharedPrefix, ...] = ()
    shared_decode: DecodeBatch | None = None  # group members' decode rows, past the prefix


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Everything attention needs for one forward, built once and shared by all layers.

    Its `AttentionPlan` (masks, padded tables, cascade groups) is made on first use: the
    fused path never reads it, and making it took ~150 us of a SmolLM2 decode step (~500 us
    of Gemma 3's, a view per KV group)."""

    query_lens: list[int]
    context_lens: list[int]
    block_size: int
    positions: torch.Tensor  # [T] position of each new token in its sequence
    slot_mapping: torch.Tensor  # [T] physical slot each new token's K/V is written to
    last_token_rows: torch.Tensor  # [N] row of each sequence's last new token
    share_limits: tuple[int, int] | None = None  # cascade (min blocks, min saved); None: off
    lone_table: tuple[int, ...] | None = None  # a batch of one sequence: its blocks
    block_tables: tuple[tuple[int, ...], ...] = ()
    window: int = 0  # 0: full attention; else each query sees its last `window` positions
    group_views: tuple[AttentionMetadata, ...] = ()  # per window group of a hybrid layout
    _windowed: dict[int, AttentionMetadata] = field(default_factory=dict, repr=False)
    _plans: list[AttentionPlan] = field(default_factory=list, init=False, repr=False)

    @property
    def num_tokens(self) -> int:
        """Rows in the flattened batch."""
        return int(self.positions.shape[0])

    @property
    def plan(self) -> AttentionPlan:
        """The batch's `AttentionPlan`, made once."""
        if not self._plans:
            self._plans.append(_plan(self))
        return self._plans[0]

    @property
    def decode(self) -> DecodeBatch | None:
        return self.plan.decode

    @property
    def prefills(self) -> tuple[PrefillSeq, ...]:
        return self.plan.prefills

    @property
    def shared_prefixes(self) -> tuple[SharedPrefix, ...]:
        return self.plan.shared_prefixes

    @property
    def shared_decode(self) -> DecodeBatch | None:
        return self.plan.shared_decode

    def windowed(self, window: int) -> AttentionMetadata:
        """The same batch for a sliding-window layer: each query attends to the last
        `window` positions up to its own (no cascade groups); built once per step."""
        if window <= 0 or max(self.context_lens) <= window:
            return self
        if window not in self._windowed:
            self._windowed[window] = window_view(
                self.query_lens, self.context_lens, self.block_tables, self.block_size, window
            )
        return self._windowed[window]

    def for_group(self, group: int, window: int) -> AttentionMetadata:
        """What a layer of KV group `group` reads and writes: group 0 (full layers, or every
        layer of an all-full layout) this batch, windowed for a window layer; a window group
        of a hybrid layout its own view over its own pages."""
        return self.windowed(window) if group == 0 else self.group_views[group - 1]

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        share_prefixes: bool = True,
        min_shared_blocks: int | None = None,
        min_saved_tokens: int | None = None,
        window: int = 0,
    ) -> AttentionMetadata:
        """Metadata for a batch where sequence i adds its last `query_lens[i]` positions.

        With `share_prefixes`, groups of >= 2 sequences sharing >= `min_shared_blocks`
        leading blocks before their queries, that save >= `min_saved_tokens` gathered
        tokens, get cascade attention (`shared_prefixes`, `shared_decode`). The limits
        default to `MIN_SHARED_BLOCKS` and `MIN_SAVED_TOKENS`. A `window` masks each query
        to its last `window` positions (a sliding-window layer).
        """
        _validate(query_lens, context_lens, block_tables, block_size)
        positions, slots = _positions_and_slots(query_lens, context_lens, block_tables, block_size)
        share_limits = None
        if share_prefixes:
            min_blocks = MIN_SHARED_BLOCKS if min_shared_blocks is None else min_shared_blocks
            _check_min_blocks(min_blocks)  # now, though the groups are found on first use
            min_saved = MIN_SAVED_TOKENS if min_saved_tokens is None else min_saved_tokens
            share_limits = (min_blocks, cdiv(min_saved, block_size))
        lone = None
        if len(query_lens) == 1:
            lone = tuple(block_tables[0][: cdiv(context_lens[0], block_size)])
        last_rows = list(accumulate(query_lens))
        return cls(
            list(query_lens), list(context_lens), block_size,
            torch.tensor(positions, dtype=torch.long), torch.tensor(slots, dtype=torch.long),
            torch.tensor(last_rows, dtype=torch.long) - 1, share_limits,
            lone, tuple(map(tuple, block_tables)), window,
        )  # fmt: skip


def _plan(metadata: AttentionMetadata) -> AttentionPlan:
    """The decode batch, prefills and cascade groups of ``metadata``'s batch."""
    query_lens, context_lens = metadata.query_lens, metadata.context_lens
    tables, block_size, limits = metadata.block_tables, metadata.block_size, metadata.share_limits
    groups: list[tuple[list[int], int]] = []
    if limits is not None:
        groups = find_shared_prefixes(query_lens, context_lens, tables, block_size, *limits)
    key_starts = [0] * len(query_lens)
    for seqs, num_blocks in groups:
        for i in seqs:
            key_starts[i] = num_blocks * block_size
    starts = list(accumulate(query_lens, initial=0))
    parts = _Parts(
        query_lens, context_lens, tables, block_size, starts, key_starts, metadata.window
    )
    return AttentionPlan(
        parts.decode(shared=False), parts.prefills(),
        tuple(parts.shared_prefix(seqs, n) for seqs, n in groups), parts.decode(shared=True),
    )  # fmt: skip


def window_view(
    query_lens: list[int],
    context_lens: list[int],
    tables: Sequence[Sequence[int]],
    block_size: int,
    window: int,
) -> AttentionMetadata:
    """The batch as a sliding-window layer reads it: each sequence from the first block
    any of its queries reads (the blocks before it are skipped, not gathered and masked:
    a hybrid layout has given their pages back); the slots are the same as unshifted."""
    contexts, shifted = [], []
    for q, c, table in zip(query_lens, context_lens, tables, strict=True):
        skip = max(0, c - q - window + 1) // block_size
        contexts.append(c - skip * block_size)
        shifted.append(list(table[skip:]))
    return AttentionMetadata.build(
        query_lens, contexts, shifted, block_size, share_prefixes=False, window=window
    )


def _validate(
    query_lens: list[int], context_lens: list[int], block_tables: list[list[int]], block_size: int
) -> None:
    """Raise ValueError unless the batch is well formed."""
    if not (len(query_lens) == len(context_lens) == len(block_tables)) or not query_lens:
        raise ValueError("query_lens, context_lens and block_tables must be non-empty, same length")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    for i, (q, c, table) in enumerate(zip(query_lens, context_lens, block_tables, strict=True)):
        if not 1 <= q <= c:
            raise ValueError(f"sequence {i}: need 1 <= query_len <= context_len, got {q}, {c}")
        if len(table) * block_size < c:
            raise ValueError(f"sequence {i}: {len(table)} blocks cannot hold {c} tokens")


def _positions_and_slots(
    query_lens: list[int], context_lens: list[int], block_tables: list[list[int]], block_size: int
) -> tuple[list[int], list[int]]:
    """Positions of the new tokens and the physical slots they go to, one block run at a time."""
    positions: list[int] = []
    slots: list[int] = []
    for q, c, table in zip(query_lens, context_lens, block_tables, strict=True):
        positions.extend(range(c - q, c))
        pos = c - q
        while pos < c:
            index, offset = divmod(pos, block_size)
            run = min(c - pos, block_size - offset)
            base = table[index] * block_size
            slots.extend(range(base + offset, base + offset + run))
            pos += run
    return positions, slots


# --- finding shared prefixes -------------------------------------------------------------


def find_shared_prefixes(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    min_blocks: int = MIN_SHARED_BLOCKS,
    min_saved_blocks: int = 0,
) -> list[tuple[list[int], int]]:
    """Disjoint groups `(sequence indices, shared blocks)` worth a cascade, best first.

    A group's sequences have the same first `shared blocks` ids in their tables, all wholly
    before each member's first new token; it shares >= `min_blocks` and saves, as
    `(members - 1) * shared blocks`, >= `min_saved_blocks`. The choice saving the most
    block gathers in total wins.
    """
    _check_min_blocks(min_blocks)
    limits = (min_blocks, min_saved_blocks)
    usable = [(c - q) // block_size for q, c in zip(query_lens, context_lens, strict=True)]
    buckets: dict[int, list[int]] = {}
    for i, blocks in enumerate(usable):
        if blocks >= min_blocks:
            buckets.setdefault(block_tables[i][0], []).append(i)
    groups: list[tuple[list[int], int]] = []
    for members in buckets.values():
        if len(members) > 1:
            groups += _best_groups(members, 1, block_tables, usable, limits)[1]
    return sorted(groups, key=lambda g: (len(g[0]) - 1) * g[1], reverse=True)


def _check_min_blocks(min_blocks: int) -> None:
    """ValueError unless a cascade group's minimum of shared blocks is positive."""
    if min_blocks < 1:
        raise ValueError(f"min_shared_blocks must be positive, got {min_blocks}")


def _best_groups(
    members: list[int],
    depth: int,
    tables: Sequence[Sequence[int]],
    usable: list[int],
    limits: tuple[int, int],
) -> tuple[int, list[tuple[list[int], int]]]:
    """Best (blocks saved, groups) for `members`, which share their first `depth` blocks.

    Take all members down to where the first one drops out or diverges, or split there and
    recurse into the branches, whichever saves more.
    """
    ref = members[0]
    common = min(
        _common_blocks(tables[ref], tables[i], depth, min(usable[i], usable[ref])) for i in members
    )
    saved = (len(members) - 1) * common
    if common < limits[0] or saved < max(limits[1], 1):
        saved = 0
    branches: dict[int, list[int]] = {}
    for i in members:
        if usable[i] > common:
            branches.setdefault(tables[i][common], []).append(i)
    split_saved, split_groups = 0, []
    for branch in branches.values():
        if len(branch) > 1:
            branch_saved, groups = _best_groups(branch, common + 1, tables, usable, limits)
            split_saved += branch_saved
            split_groups += groups
    if split_saved > saved:
        return split_saved, split_groups
    return saved, ([(members, common)] if saved else [])


def _common_blocks(a: Sequence[int], b: Sequence[int], start: int, stop: int) -> int:
    """Length of the common leading run of `a` and `b`, known equal before `start`, <= `stop`."""
    if a[start:stop] == b[start:stop]:
        return max(start, stop)
    return next(i for i in range(start, stop) if a[i] != b[i])


# --- per-step attention plans ------------------------------------------------------------


@dataclass(slots=True)
class _Parts:
    """The batch, with the context position each sequence's own keys start at."""

    query_lens: list[int]
    context_lens: list[int]
    tables: Sequence[Sequence[int]]
    block_size: int
    starts: list[int]
    key_starts: list[int]
    window: int = 0

    def prefills(self) -> tuple[PrefillSeq, ...]:
        """Every sequence with several new tokens."""
        return tuple(self._prefill(i) for i, q in enumerate(self.query_lens) if q > 1)

    def _prefill(self, i: int) -> PrefillSeq:
        """Sequence i over keys from its `key_start`; new token j sees positions <= its own."""
        q, c, key_start = self.query_lens[i], self.context_lens[i], self.key_starts[i]
        ids = self.tables[i][key_start // self.block_size : cdiv(c, self.block_size)]
        mask = bias = None
        if c - q > key_start or (self.window and c > self.window):
            keys, queries = torch.arange(key_start, c)[None, :], torch.arange(c - q, c)[:, None]
            mask = keys <= queries
            if self.window:
                mask &= keys > queries - self.window
            bias = _bias(mask) if key_start else None
        block_ids = torch.tensor(ids, dtype=torch.long)
        split = not self.window and not key_start and q >= MIN_SPLIT_QUERIES
        prefix = c - q if split else 0
        return PrefillSeq(self.starts[i], q, c, block_ids, mask, key_start, bias, prefix)

    def decode(self, shared: bool) -> DecodeBatch | None:
        """Query-length-1 sequences in (or outside) shared groups, over 0-padded tables."""
        seqs = [
            i
            for i, q in enumerate(self.query_lens)
            if q == 1 and (self.key_starts[i] > 0) == shared
        ]
        if not seqs:
            return None
        lens = [self.context_lens[i] - self.key_starts[i] for i in seqs]
        width = cdiv(max(lens), self.block_size)
        padded: list[int] = []
        for i, n in zip(seqs, lens, strict=True):
            skip = self.key_starts[i] // self.block_size
            used = cdiv(n, self.block_size)
            padded.extend(self.tables[i][skip : skip + used])
            padded.extend([0] * (width - used))
        keys, ends = torch.arange(width * self.block_size)[None, :], torch.tensor(lens)[:, None]
        mask = keys < ends
        if self.window:
            mask &= keys >= ends - self.window
        rows = _rows([range(self.starts[i], self.starts[i] + 1) for i in seqs])
        block_ids = torch.tensor(padded, dtype=torch.long)
        mask = mask[:, None, None, :]
        bias = _bias(mask) if shared else None
        return DecodeBatch(rows, len(seqs), block_ids, mask, bias, max(lens), self.window)

    def shared_prefix(self, seqs: list[int], num_blocks: int) -> SharedPrefix:
        """The group's shared blocks and all of its members' query rows."""
        rows = _rows([range(self.starts[i], self.starts[i + 1]) for i in seqs])
        block_ids = torch.tensor(self.tables[seqs[0]][:num_blocks], dtype=torch.long)
        return SharedPrefix(tuple(seqs), rows, block_ids, num_blocks * self.block_size)


def _bias(mask: torch.Tensor) -> torch.Tensor:
    """A boolean keep-mask as an additive fp32 one (0 or -inf)."""
    return torch.zeros(mask.shape).masked_fill_(~mask, -torch.inf)


def _rows(ranges: list[range]) -> Rows:
    """Rows of the flattened batch: a slice when they are contiguous, else an index tensor."""
    if all(a.stop == b.start for a, b in pairwise(ranges)):
        return slice(ranges[0].start, ranges[-1].stop)
    return torch.tensor([r for span in ranges for r in span], dtype=torch.long)


# --- attention ---------------------------------------------------------------------------


def paged_attention(
    q: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the batch's queries `[T, heads, head_dim]` over their contexts.

    The batch's K/V must already be in `kv_cache_layer`. `k_new`/`v_new` (`[T, kv_heads,
    head_dim]`, optional) let a sequence whose keys are all new skip gathering them.
    """
    decode, cache = metadata.decode, kv_cache_layer
    if decode is not None and not metadata.prefills and not metadata.shared_prefixes:
        return _decode_attention(q[decode.rows], cache, decode, scale)
    out = torch.empty_like(q)
    # Log-sum-exp of each group member's own-keys part, for the merge with the shared part.
    lse = torch.empty(q.shape[:2], dtype=_acc(q.dtype)) if metadata.shared_prefixes else None
    if decode is not None:
        out[decode.rows] = _decode_attention(q[decode.rows], cache, decode, scale)
    rest = metadata.shared_decode
    if rest is not None and lse is not None:
        out[rest.rows], lse[rest.rows] = _decode_attention_lse(q[rest.rows], cache, rest, scale)
    for seq in metadata.prefills:
        rows = slice(seq.start, seq.start + seq.query_len)
        fresh = None if k_new is None or v_new is None else (k_new[rows], v_new[rows])
        if seq.key_start and lse is not None:
            out[rows], lse[rows] = _prefill_attention_lse(q[rows], cache, seq, scale, fresh)
        else:
            out[rows] = _prefill_attention(q[rows], cache, seq, scale, fresh)
    for group in metadata.shared_prefixes:
        assert lse is not None
        shared_out, shared_lse = _shared_attention(q[group.rows], cache, group, scale)
        out[group.rows] = _merge(shared_out, shared_lse, out[group.rows], lse[group.rows])
    return out


def lone_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query row `[1, heads, dim]` over all its keys/values `[1, kv_heads, L, dim]`."""
    num_heads, head_dim = q.shape[1:]
    grouped = q.reshape(1, keys.shape[1], num_heads // keys.shape[1], head_dim)
    out = F.scaled_dot_product_attention(grouped, keys.to(q.dtype), values.to(q.dtype), scale=scale)
    return out.reshape(q.shape)


def gather_context(
    cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V `[num_tokens, kv_heads, dim]` of a context held in `block_ids`, in order."""
    return _gather(cache, 0, block_ids)[:num_tokens], _gather(cache, 1, block_ids)[:num_tokens]


def _gather(cache: torch.Tensor, which: int, block_ids: torch.Tensor) -> torch.Tensor:
    """K (which=0) or V (1) of `block_ids`, concatenated: `[len * block_size, heads, dim]`.

    An int8 cache (uint8 rows of codes and scale, `kv_quant.py`) comes back dequantized
    to fp32; a bf16 one as stored, or widened to fp32 where the native kernels gather in
    one pass (callers convert to the query's dtype, exactly).
    """
    if cache.dtype in NATIVE_GATHER and cache.is_contiguous() and kernels.available():
        return torch.ops.prefixcache.gather_kv(cache, which, block_ids)
    return gather_eager(cache, which, block_ids)


def gather_eager(cache: torch.Tensor, which: int, block_ids: torch.Tensor) -> torch.Tensor:
    """`_gather` in torch ops: an index_select, then int8 rows dequantized."""
    blocks = cache.select(1, which).index_select(0, block_ids)
    rows = blocks.view(-1, cache.shape[3], cache.shape[4])
    return dequantize_int8(rows) if cache.dtype == torch.uint8 else rows


def _decode_kv(
    q: torch.Tensor, cache: torch.Tensor, decode: DecodeBatch
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries grouped per KV head `[n, kv_heads, group, dim]` and K, V `[n, kv_heads, W, dim]`."""
    n, num_heads, head_dim = q.shape
    num_kv_heads = cache.shape[3]
    k = _gather(cache, 0, decode.block_ids).view(n, -1, num_kv_heads, head_dim).transpose(1, 2)
    v = _gather(cache, 1, decode.block_ids).view(n, -1, num_kv_heads, head_dim).transpose(1, 2)
    if n == 1:  # a lone sequence: cut its keys to its length instead of masking the rest
        first = max(0, decode.num_keys - decode.window) if decode.window else 0
        k, v = k[:, :, first : decode.num_keys], v[:, :, first : decode.num_keys]
    grouped = q.reshape(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
    return grouped, k.to(q.dtype), v.to(q.dtype)


def _decode_attention(
    q: torch.Tensor, cache: torch.Tensor, decode: DecodeBatch, scale: float
) -> torch.Tensor:
    """One query per sequence; the query heads of a KV group become that group's rows."""
    grouped, k, v = _decode_kv(q, cache, decode)
    mask = None if decode.num_seqs == 1 else decode.mask
    out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask, scale=scale)
    return out.reshape(q.shape)


def _decode_attention_lse(
    q: torch.Tensor, cache: torch.Tensor, decode: DecodeBatch, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_decode_attention` that also returns each row's log-sum-exp `[n, heads]`."""
    assert decode.bias is not None
    grouped, k, v = _decode_kv(q, cache, decode)
    bias = None if decode.num_seqs == 1 else decode.bias.to(q.dtype)
    out, lse = attention_with_lse(grouped, k, v, scale, bias)
    return out.reshape(q.shape), lse.reshape(q.shape[:2])


def _prefill_kv(
    q: torch.Tensor,
    cache: torch.Tensor,
    seq: PrefillSeq,
    fresh: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries `[1, heads, query_len, dim]` and K, V `[1, kv_heads, keys, dim]` of a prefill."""
    if fresh is not None and seq.mask is None:
        k, v = fresh
    else:
        k = _gather(cache, 0, seq.block_ids)[: seq.context_len - seq.key_start]
        v = _gather(cache, 1, seq.block_ids)[: seq.context_len - seq.key_start]
    return (
        q.transpose(0, 1)[None],
        k.to(q.dtype).transpose(0, 1)[None],
        v.to(q.dtype).transpose(0, 1)[None],
    )


def _prefill_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    seq: PrefillSeq,
    scale: float,
    fresh: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """Queries `[query_len, heads, dim]` of one sequence over its gathered context."""
    q4, k, v = _prefill_kv(q, cache, seq, fresh)
    if seq.prefix_keys:  # the prefix unmasked, the new keys causal, merged
        p = seq.prefix_keys
        before, lse_before = attention_with_lse(q4, k[:, :, :p], v[:, :, :p], scale)
        own, lse_own = attention_with_lse(q4, k[:, :, p:], v[:, :, p:], scale, causal=True)
        return _merge(before, lse_before, own, lse_own)[0].transpose(0, 1)
    out = F.scaled_dot_product_attention(
        q4, k, v, attn_mask=seq.mask, is_causal=seq.mask is None, scale=scale, enable_gqa=True
    )
    return out[0].transpose(0, 1)


def _prefill_attention_lse(
    q: torch.Tensor,
    cache: torch.Tensor,
    seq: PrefillSeq,
    scale: float,
    fresh: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_prefill_attention` that also returns each row's log-sum-exp `[query_len, heads]`."""
    q4, k, v = _prefill_kv(q, cache, seq, fresh)
    bias = None if seq.bias is None else seq.bias.to(q.dtype)
    out, lse = attention_with_lse(q4, k, v, scale, bias, causal=seq.mask is None)
    return out[0].transpose(0, 1), lse[0].transpose(0, 1)


def _shared_attention(
    q: torch.Tensor, cache: torch.Tensor, group: SharedPrefix, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """A group's query rows `[R, heads, dim]` over its shared prefix, gathered once.

    The query heads of each KV head are folded into rows, so K/V are never repeated:
    one `[R * group, P]` attention per KV head. Returns outputs and log-sum-exps `[R, heads]`.
    """
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = cache.shape[3]
    per_kv = num_heads // num_kv_heads
    k = _gather(cache, 0, group.block_ids).to(q.dtype).transpose(0, 1)[None]
    v = _gather(cache, 1, group.block_ids).to(q.dtype).transpose(0, 1)[None]
    folded = q.reshape(num_rows, num_kv_heads, per_kv, head_dim).transpose(0, 1)
    out, lse = attention_with_lse(folded.reshape(1, num_kv_heads, -1, head_dim), k, v, scale)
    out = out.view(num_kv_heads, num_rows, per_kv, head_dim).transpose(0, 1)
    lse = lse.view(num_kv_heads, num_rows, per_kv).transpose(0, 1)
    return out.reshape(q.shape), lse.reshape(num_rows, num_heads)


def _merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """Softmax attention over the union of two disjoint key sets, from each set's result."""
    acc = _acc(out_a.dtype)
    weight_a = torch.sigmoid(lse_a - lse_b).to(acc).unsqueeze(-1)  # e^a / (e^a + e^b)
    return torch.lerp(out_b.to(acc), out_a.to(acc), weight_a).to(out_a.dtype)


def _acc(dtype: torch.dtype) -> torch.dtype:
    """The dtype to combine softmax pieces in: fp32, or fp64 for an fp64 model."""
    return torch.promote_types(dtype, torch.float32)


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    bias: torch.Tensor | None = None,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention `[B, H, L, D]` and each query's log-sum-exp of scaled scores `[B, H, L]`.

    K/V may have fewer heads than `q` (GQA). `bias` is an additive mask. Uses PyTorch's CPU
    flash kernel, which returns the log-sum-exp; `_math_attention_with_lse` otherwise.
    """
    if _FLASH_WITH_LSE is not None and q.device.type == "cpu":
        out, lse = _FLASH_WITH_LSE(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
        return out, lse
    return _math_attention_with_lse(q, k, v, scale, bias, causal)


def _math_attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    bias: torch.Tensor | None = None,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`attention_with_lse` in plain matmuls (materialises the scores)."""
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).to(_acc(q.dtype)).mul_(scale)
    if bias is not None:
        scores += bias
    if causal:
        scores.masked_fill_(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), -torch.inf)
    lse = scores.logsumexp(-1)
    out = torch.matmul(scores.sub_(lse.unsqueeze(-1)).exp_().to(v.dtype), v)
    return out, lse


def _flash_with_lse() -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """PyTorch's private CPU flash-attention op, which also returns the log-sum-exp."""
    try:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    except (AttributeError, RuntimeError):
        return None


_FLASH_WITH_LSE = _flash_with_lse()
