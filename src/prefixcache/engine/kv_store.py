"""Physical paged KV memory: one tensor per layer, addressed by block ids from the cache core."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from prefixcache.engine import kernels
from prefixcache.engine.anonymous_memory import anonymous_zeros
from prefixcache.engine.config import KV_CACHE_DTYPES, ModelConfig
from prefixcache.engine.kv_layout import KVLayout
from prefixcache.engine.kv_quant import (
    SCALE_BYTES,
    dequantize_codes,
    packed_width,
    quantize_int8,
)

# `--kv-cache-dtype` names and what the store keeps for each (int8: packed, `kv_quant.py`).
KV_DTYPES: dict[str, torch.dtype] = dict(
    zip(KV_CACHE_DTYPES, (torch.float32, torch.bfloat16, torch.int8), strict=True)
)
MEMO_MAPPINGS = 16  # slot mappings whose rows are remembered: one per group of a forward
NATIVE_WRITE = (torch.bfloat16, torch.int8)  # what `kernels/kv_rows.cpp` stores from fp32
RowPairs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # see KVStore._row_pairs


class KVStore:
    """Per-layer `[num_blocks, 2, block_size, num_kv_heads, row]` tensors (0 = K, 1 = V).

    With a hybrid layout (`kv_layout.py`) a page holds fewer layers than the model has:
    layers of different groups share a physical tensor (`slots`), each at its own group's
    page ids, so `layers[l]` is physical tensor `slots[l]`.

    A token at position p of a sequence lives at slot `block_table[p // block_size] *
    block_size + p % block_size`; `write` takes those slots, attention reads whole blocks.
    A row is `head_dim` values of `dtype`; for `torch.int8` it is `head_dim + 4` bytes of
    uint8, the codes then their fp32 scale (`kv_quant.py`), and attention dequantizes.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        slots: Sequence[int] | None = None,
        groups: Sequence[int] | None = None,
    ) -> None:
        assert num_layers > 0 and num_blocks > 0 and block_size > 0
        slots = list(range(num_layers)) if slots is None else list(slots)
        self.groups = [0] * num_layers if groups is None else list(groups)  # per layer
        assert len(slots) == num_layers and set(slots) == set(range(max(slots) + 1))
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype  # what K/V are stored as (torch.int8: packed with scales)
        self.storage_dtype = torch.uint8 if dtype == torch.int8 else dtype
        self.row_width = packed_width(head_dim) if dtype == torch.int8 else head_dim
        shape = (num_blocks, 2, block_size, num_kv_heads, self.row_width)
        self.pages: list[torch.Tensor] = [  # the physical tensors: a page's layers
            anonymous_zeros(shape, self.storage_dtype) for _ in range(max(slots) + 1)
        ]
        self.layers: list[torch.Tensor] = [self.pages[slot] for slot in slots]
        self._memo: dict[int, RowPairs] = {}

    @classmethod
    def for_model(
        cls,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        layout: KVLayout | None = None,
    ) -> KVStore:
        """A store shaped for `config`'s layers and KV heads, and `layout`'s pages."""
        return cls(
            config.num_layers,
            num_blocks,
            block_size,
            config.num_kv_heads,
            config.head_dim,
            dtype,
            None if layout is None else layout.slot,
            None if layout is None else layout.group,
        )

    @staticmethod
    def bytes_per_block(
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
    ) -> int:
        """Bytes one block takes across all layers (K and V), to size a pool from a budget."""
        return num_layers * 2 * block_size * num_kv_heads * row_bytes(head_dim, dtype)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes in every layer, K and V (scales included): all-full."""
        return self.num_layers * 2 * self.num_kv_heads * row_bytes(self.head_dim, self.dtype)

    @property
    def bytes_per_page_token(self) -> int:
        """Bytes one token takes in one page (a group's layers), K and V."""
        return len(self.pages) * 2 * self.num_kv_heads * row_bytes(self.head_dim, self.dtype)

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One page across its layers: `[page layers, 2, block_size, kv_heads, row]`."""
        return (len(self.pages), 2, self.block_size, self.num_kv_heads, self.row_width)

    def read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A copy of the given blocks, `[n, *block_shape]` (safe after the slots are reused)."""
        ids = torch.tensor(list(block_ids), dtype=torch.long)
        return torch.stack([page.index_select(0, ids) for page in self.pages], dim=1)

    def write_block(self, block_id: int, payload: memoryview | bytes) -> None:
        """Fill one block in every layer from `block_shape` values in this store's dtype."""
        with warnings.catch_warnings():  # a read-only buffer is fine: it is only copied from
            warnings.simplefilter("ignore", UserWarning)
            values = torch.frombuffer(payload, dtype=self.storage_dtype).view(self.block_shape)
        for page, value in zip(self.pages, values, strict=True):
            page[block_id].copy_(value)

    @property
    def nbytes(self) -> int:
        """Total bytes held by the store."""
        return sum(t.numel() * t.element_size() for t in self.pages)

    def write(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store `k`, `v` (`[T, kv_heads, head_dim]`) of T tokens at their slots (`[T]`).

        Returns them as a read gives them back (rounded to bf16, or dequantized from int8),
        in their own dtype: attention over the new tokens must see what the cache holds, so
        a prompt computes the same with its prefix cached or not.
        """
        if self.dtype in NATIVE_WRITE and k.dtype == torch.float32 and kernels.available():
            return self.write_native(layer, k, v, slot_mapping)
        return self.write_eager(layer, k, v, slot_mapping)

    def write_eager(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`write` in torch ops."""
        k_rows, v_rows = self._rows(slot_mapping)
        flat = self.layers[layer].view(-1, self.num_kv_heads, self.row_width)
        k_stored, k_read = self._encode(k)
        v_stored, v_read = self._encode(v)
        flat.index_copy_(0, k_rows, k_stored)
        flat.index_copy_(0, v_rows, v_stored)
        return k_read, v_read

    def write_native(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`write` in one native pass per row (bf16, int8: the same bits as `_encode`)."""
        k_read = k.clone(memory_format=torch.contiguous_format)  # one copy, filled in place
        v_read = v.clone(memory_format=torch.contiguous_format)
        rows = self.rows_of(slot_mapping)
        torch.ops.prefixcache.write_kv_(self.layers[layer], rows, k_read, v_read)
        return k_read, v_read

    def _encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`x` as stored, and as it reads back in `x`'s dtype."""
        if self.dtype == torch.int8:
            packed, codes, scale = quantize_int8(x)
            return packed, dequantize_codes(codes, scale).to(x.dtype)
        stored = x.to(self.dtype)
        return stored, x if stored is x else stored.to(x.dtype)

    def rows_of(self, slot_mapping: torch.Tensor) -> torch.Tensor:
        """`[T, 2]` int64: each slot's K and V rows of the flattened
        `[num_blocks * 2 * block_size]` view (what `write` fills)."""
        return self._row_pairs(slot_mapping)[3]

    def _rows(self, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of the flattened `[num_blocks * 2 * block_size]` view that hold K and V."""
        _, k_rows, v_rows, _ = self._row_pairs(slot_mapping)
        return k_rows, v_rows

    def _row_pairs(self, slot_mapping: torch.Tensor) -> RowPairs:
        """The mapping, its K rows, V rows and both as `[T, 2]`.

        Memoized on the tensor object (every layer of a group passes the same mapping in a
        forward), so a caller must not change a mapping in place between writes.
        """
        memo = self._memo.get(id(slot_mapping))
        if memo is not None and memo[0] is slot_mapping:
            return memo
        block = slot_mapping.div(self.block_size, rounding_mode="floor")
        offset = slot_mapping - block * self.block_size
        k_rows = block * (2 * self.block_size) + offset
        v_rows = k_rows + self.block_size
        if len(self._memo) >= MEMO_MAPPINGS:
            self._memo.clear()
        memo = (slot_mapping, k_rows, v_rows, torch.stack((k_rows, v_rows), 1).contiguous())
        self._memo[id(slot_mapping)] = memo
        return memo

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy each `src` block onto its `dst` in every layer (copy-on-write).

        All sources are read before any destination is written.
        """
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long)
        for cache in self.pages:
            cache.index_copy_(0, dst, cache.index_select(0, src))

    def zero_blocks(self, block_ids: Sequence[int]) -> None:
        """Zero the given blocks in every layer."""
        if not block_ids:
            return
        ids = torch.tensor(list(block_ids), dtype=torch.long)
        for cache in self.pages:
            cache.index_fill_(0, ids, 0.0)


def row_bytes(head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one token's K (or V) for one KV head: values, and an int8 row's scale."""
    if dtype == torch.int8:
        return head_dim + SCALE_BYTES
    return head_dim * dtype.itemsize


def kv_dtype(name: str) -> torch.dtype:
    """The store dtype of a `--kv-cache-dtype` name; ValueError naming the choices."""
    if name not in KV_DTYPES:
        raise ValueError(f"kv_cache_dtype {name!r} is not one of {', '.join(KV_DTYPES)}")
    return KV_DTYPES[name]
