"""Paged attention on CPU: each sequence's new queries attend to its whole context in blocks.

A step's batch is flattened: sequence i contributes its last `query_lens[i]` positions out
of `context_lens[i]`. Decode rows (query length 1) share one padded gather and one masked
SDPA call; each prefill or chunk gets its own SDPA call with an offset causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class PrefillSeq:
    """One sequence with several new tokens: rows `start:start + query_len` of the batch."""

    start: int
    query_len: int
    context_len: int
    block_ids: torch.Tensor  # [ceil(context_len / block_size)] physical blocks, in order
    mask: torch.Tensor | None  # [query_len, context_len] bool; None when no earlier context


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    """All sequences with one new token, attended together over padded block tables."""

    rows: torch.Tensor | slice  # their rows in the flattened batch
    num_seqs: int
    block_ids: torch.Tensor  # [num_seqs * max_blocks] padded block tables, flattened
    mask: torch.Tensor  # [num_seqs, 1, 1, max_blocks * block_size] bool, True = attend


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Everything attention needs for one forward, built once and shared by all layers."""

    query_lens: list[int]
    context_lens: list[int]
    block_size: int
    positions: torch.Tensor  # [T] position of each new token in its sequence
    slot_mapping: torch.Tensor  # [T] physical slot each new token's K/V is written to
    last_token_rows: torch.Tensor  # [N] row of each sequence's last new token
    decode: DecodeBatch | None
    prefills: tuple[PrefillSeq, ...]

    @property
    def num_tokens(self) -> int:
        """Rows in the flattened batch."""
        return int(self.positions.shape[0])

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
    ) -> AttentionMetadata:
        """Metadata for a batch where sequence i adds its last `query_lens[i]` positions."""
        _validate(query_lens, context_lens, block_tables, block_size)
        positions, slots = _positions_and_slots(query_lens, context_lens, block_tables, block_size)
        starts = list(accumulate(query_lens, initial=0))
        prefills = tuple(
            _prefill_seq(starts[i], q, c, block_tables[i], block_size)
            for i, (q, c) in enumerate(zip(query_lens, context_lens, strict=True))
            if q > 1
        )
        decode = _decode_batch(query_lens, context_lens, starts, block_tables, block_size)
        return cls(
            list(query_lens), list(context_lens), block_size,
            torch.tensor(positions, dtype=torch.long), torch.tensor(slots, dtype=torch.long),
            torch.tensor(starts[1:], dtype=torch.long) - 1, decode, prefills,
        )  # fmt: skip


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


def _num_blocks(context_len: int, block_size: int) -> int:
    """Blocks needed to hold `context_len` tokens."""
    return -(-context_len // block_size)


def _prefill_seq(
    start: int, query_len: int, context_len: int, table: list[int], block_size: int
) -> PrefillSeq:
    """A prefill or chunk; its mask lets new token i see positions <= its own."""
    block_ids = torch.tensor(table[: _num_blocks(context_len, block_size)], dtype=torch.long)
    mask = None
    if context_len > query_len:
        first = context_len - query_len
        mask = torch.arange(context_len)[None, :] <= torch.arange(first, context_len)[:, None]
    return PrefillSeq(start, query_len, context_len, block_ids, mask)


def _decode_batch(
    query_lens: list[int],
    context_lens: list[int],
    starts: list[int],
    block_tables: list[list[int]],
    block_size: int,
) -> DecodeBatch | None:
    """Group the query-length-1 sequences over 0-padded block tables; None if there are none."""
    seqs = [i for i, q in enumerate(query_lens) if q == 1]
    if not seqs:
        return None
    lens = [context_lens[i] for i in seqs]
    width = _num_blocks(max(lens), block_size)
    padded: list[int] = []
    for i, n in zip(seqs, lens, strict=True):
        used = _num_blocks(n, block_size)
        padded.extend(block_tables[i][:used])
        padded.extend([0] * (width - used))
    mask = torch.arange(width * block_size)[None, :] < torch.tensor(lens)[:, None]
    row_list = [starts[i] for i in seqs]
    rows: torch.Tensor | slice = torch.tensor(row_list, dtype=torch.long)
    if row_list[-1] - row_list[0] == len(row_list) - 1:
        rows = slice(row_list[0], row_list[-1] + 1)
    block_ids = torch.tensor(padded, dtype=torch.long)
    return DecodeBatch(rows, len(seqs), block_ids, mask[:, None, None, :])


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
    head_dim]`, optional) let a sequence with no earlier context skip gathering its own K/V.
    """
    decode = metadata.decode
    if decode is not None and not metadata.prefills:
        return _decode_attention(q[decode.rows], kv_cache_layer, decode, scale)
    out = torch.empty_like(q)
    if decode is not None:
        out[decode.rows] = _decode_attention(q[decode.rows], kv_cache_layer, decode, scale)
    for seq in metadata.prefills:
        rows = slice(seq.start, seq.start + seq.query_len)
        fresh = None if k_new is None or v_new is None else (k_new[rows], v_new[rows])
        out[rows] = _prefill_attention(q[rows], kv_cache_layer, seq, scale, fresh)
    return out


def _gather(cache: torch.Tensor, which: int, block_ids: torch.Tensor) -> torch.Tensor:
    """K (which=0) or V (1) of `block_ids`, concatenated: `[len * block_size, heads, dim]`."""
    blocks = cache.select(1, which).index_select(0, block_ids)
    return blocks.view(-1, cache.shape[3], cache.shape[4])


def _decode_attention(
    q: torch.Tensor, cache: torch.Tensor, decode: DecodeBatch, scale: float
) -> torch.Tensor:
    """One query per sequence; the query heads of a KV group become that group's rows."""
    n, num_heads, head_dim = q.shape
    num_kv_heads = cache.shape[3]
    k = _gather(cache, 0, decode.block_ids).view(n, -1, num_kv_heads, head_dim).transpose(1, 2)
    v = _gather(cache, 1, decode.block_ids).view(n, -1, num_kv_heads, head_dim).transpose(1, 2)
    grouped = q.reshape(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(
        grouped, k.to(q.dtype), v.to(q.dtype), attn_mask=decode.mask, scale=scale
    )
    return out.reshape(n, num_heads, head_dim)


def _prefill_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    seq: PrefillSeq,
    scale: float,
    fresh: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """Queries `[query_len, heads, dim]` of one sequence over its gathered context."""
    if fresh is not None and seq.mask is None:
        k, v = fresh
    else:
        k = _gather(cache, 0, seq.block_ids)[: seq.context_len]
        v = _gather(cache, 1, seq.block_ids)[: seq.context_len]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.to(q.dtype).transpose(0, 1)[None],
        v.to(q.dtype).transpose(0, 1)[None],
        attn_mask=seq.mask,
        is_causal=seq.mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)
