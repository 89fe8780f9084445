"""A contiguous copy of the K/V of a sequence that decodes alone, so a step appends one token.

Paged attention gathers a sequence's blocks every step: for one 550-token sequence that is
26 MB of copies a step over 30 layers, about as much as the int4 weights. When a step's
batch is one decode row and the previous forward was the previous step of the same
sequence (same physical blocks, one token shorter), the copy from that step is still
exact: positions below the new token never change while a sequence holds its blocks
(shared blocks are immutable, its own are written only by its own forwards, and copies,
zeroing and tier loads between steps touch other blocks). Anything else rebuilds the copy
from the pool, which stays the one source of truth. The fused path (fused_decode.py) also
runs a short chunk of one sequence's prompt this way: the copy then holds its prefix from
the pool and the chunk's new tokens, ready for the decode steps that follow.
"""

from __future__ import annotations

import torch

from prefixcache.engine.attention import AttentionMetadata, gather_context
from prefixcache.engine.kv_store import KVStore


class LoneDecode:
    """Per layer `[kv_heads, capacity, head_dim]` K and V of the lone decoding sequence."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.table: tuple[int, ...] = ()
        self.length = 0  # tokens held, once this forward's tokens are in
        self.new_tokens = 0  # of which this forward adds
        self.rebuild = True
        self._block_ids = torch.empty(0, dtype=torch.long)
        self._previous_forward = -2
        self._forward = 0

    def prepare(
        self,
        metadata: AttentionMetadata,
        kv_store: KVStore,
        dtype: torch.dtype,
        max_rows: int = 1,
    ) -> bool:
        """Start a forward; True when one sequence adds at most `max_rows` tokens (a lone
        decode when 1), its copy then covering them: `extend` (eager) or `refill` (fused)
        every layer. The copy holds the pool's values as read (int8 dequantized), in the
        wider of the store's and the model's `dtype`."""
        self._forward += 1
        table = metadata.lone_table
        if table is None or metadata.query_lens[0] > max_rows:
            return False
        length, new = metadata.context_lens[0], metadata.query_lens[0]
        self.rebuild = not (
            self._previous_forward == self._forward - 1
            and length == self.length + new
            and table[: len(self.table)] == self.table
        )
        values = torch.float32 if kv_store.dtype == torch.int8 else kv_store.dtype
        dtype = torch.promote_types(values, dtype)
        if not self.keys or length > self.keys[0].shape[1] or self.keys[0].dtype != dtype:
            self._allocate(length, kv_store, dtype)
        if self.rebuild:
            self._block_ids = torch.tensor(table, dtype=torch.long)
        self.table, self.length, self._previous_forward = table, length, self._forward
        self.new_tokens = new
        return True

    def _allocate(self, length: int, kv_store: KVStore, dtype: torch.dtype) -> None:
        capacity = max(256, 1 << (length - 1).bit_length())
        shape = (kv_store.num_kv_heads, capacity, kv_store.head_dim)
        self.keys = [torch.empty(shape, dtype=dtype) for _ in range(kv_store.num_layers)]
        self.values = [torch.empty(shape, dtype=dtype) for _ in range(kv_store.num_layers)]
        self.rebuild = True

    def extend(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Add this step's `k`, `v` `[1, kv_heads, dim]`; all keys, values `[1, kv, L, dim]`."""
        keys, values, n = self.keys[layer], self.values[layer], self.length
        if self.rebuild:
            self._copy_from_pool(layer, cache, n)
        else:
            keys[:, n - 1].copy_(k[0])
            values[:, n - 1].copy_(v[0])
        return keys[None, :, :n], values[None, :, :n]

    def refill(self, caches: list[torch.Tensor], views: list[AttentionMetadata]) -> None:
        """For a fused forward, which writes its new tokens itself: after a rebuild, every
        layer's tokens before them that it reads, from the pool (`caches`, one per layer),
        through the layer's view of the batch (`AttentionMetadata.for_group`). A window
        layer's view starts at its window's first block, so its copy is filled from there,
        at the same positions: the tokens before it are never read."""
        n = self.length - self.new_tokens
        if not self.rebuild or n <= 0:
            return
        tables = {self.table: self._block_ids}  # the sequence's own; a window group's too
        for layer, (cache, view) in enumerate(zip(caches, views, strict=True)):
            if view.lone_table is None:
                raise ValueError("a fused forward's views must be of one sequence")
            skipped = self.length - view.context_lens[0]  # before the view's first block
            if view.lone_table not in tables:
                tables[view.lone_table] = torch.tensor(view.lone_table, dtype=torch.long)
            self._copy_from_pool(layer, cache, n, tables[view.lone_table], skipped)

    def _copy_from_pool(
        self,
        layer: int,
        cache: torch.Tensor,
        n: int,
        block_ids: torch.Tensor | None = None,
        skipped: int = 0,
    ) -> None:
        """The sequence's tokens `[skipped, n)` of `layer`, gathered from its pool blocks
        (`block_ids`: those from position `skipped` on; the sequence's own by default)."""
        ids = self._block_ids if block_ids is None else block_ids
        k_all, v_all = gather_context(cache, ids, n - skipped)
        self.keys[layer][:, skipped:n].copy_(k_all.transpose(0, 1))
        self.values[layer][:, skipped:n].copy_(v_all.transpose(0, 1))
