"""Physical paged KV memory: one tensor per layer, addressed by block ids from the cache core."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np
import torch

from prefixcache.engine.config import KV_CACHE_DTYPES, ModelConfig
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


class KVStore:
    """Per-layer `[num_blocks, 2, block_size, num_kv_heads, row]` tensors (0 = K, 1 = V).

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
    ) -> None:
        assert num_layers > 0 and num_blocks > 0 and block_size > 0
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype  # what K/V are stored as (torch.int8: packed with scales)
        self.storage_dtype = torch.uint8 if dtype == torch.int8 else dtype
        self.row_width = packed_width(head_dim) if dtype == torch.int8 else head_dim
        shape = (num_blocks, 2, block_size, num_kv_heads, self.row_width)
        self.layers: list[torch.Tensor] = [
            _zeros(shape, self.storage_dtype) for _ in range(num_layers)
        ]
        self._memo_slots: torch.Tensor | None = None
        self._memo_rows: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def for_model(
        cls, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype
    ) -> KVStore:
        """A store shaped for `config`'s layers and KV heads."""
        return cls(
            config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim, dtype
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
        """Bytes one cached token takes across all layers, K and V (scales included)."""
        return self.num_layers * 2 * self.num_kv_heads * row_bytes(self.head_dim, self.dtype)

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block across all layers: `[num_layers, 2, block_size, kv_heads, row]`."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.row_width)

    def read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A copy of the given blocks, `[n, *block_shape]` (safe after the slots are reused)."""
        ids = torch.tensor(list(block_ids), dtype=torch.long)
        return torch.stack([layer.index_select(0, ids) for layer in self.layers], dim=1)

    def write_block(self, block_id: int, payload: memoryview | bytes) -> None:
        """Fill one block in every layer from `block_shape` values in this store's dtype."""
        with warnings.catch_warnings():  # a read-only buffer is fine: it is only copied from
            warnings.simplefilter("ignore", UserWarning)
            values = torch.frombuffer(payload, dtype=self.storage_dtype).view(self.block_shape)
        for layer, value in zip(self.layers, values, strict=True):
            layer[block_id].copy_(value)

    @property
    def nbytes(self) -> int:
        """Total bytes held by the store."""
        return sum(t.numel() * t.element_size() for t in self.layers)

    def write(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store `k`, `v` (`[T, kv_heads, head_dim]`) of T tokens at their slots (`[T]`).

        Returns them as a read gives them back (rounded to bf16, or dequantized from int8),
        in their own dtype: attention over the new tokens must see what the cache holds, so
        a prompt computes the same with its prefix cached or not.
        """
        k_rows, v_rows = self._rows(slot_mapping)
        flat = self.layers[layer].view(-1, self.num_kv_heads, self.row_width)
        k_stored, k_read = self._encode(k)
        v_stored, v_read = self._encode(v)
        flat.index_copy_(0, k_rows, k_stored)
        flat.index_copy_(0, v_rows, v_stored)
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
        k_rows, v_rows = self._rows(slot_mapping)
        return torch.stack((k_rows, v_rows), 1).contiguous()

    def _rows(self, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of the flattened `[num_blocks * 2 * block_size]` view that hold K and V.

        Memoized on the tensor object (every layer of a forward passes the same mapping), so
        a caller must not change a mapping in place between writes.
        """
        if self._memo_slots is not slot_mapping or self._memo_rows is None:
            block = slot_mapping.div(self.block_size, rounding_mode="floor")
            offset = slot_mapping - block * self.block_size
            k_rows = block * (2 * self.block_size) + offset
            self._memo_rows = (k_rows, k_rows + self.block_size)
            self._memo_slots = slot_mapping
        return self._memo_rows

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy each `src` block onto its `dst` in every layer (copy-on-write).

        All sources are read before any destination is written.
        """
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long)
        for cache in self.layers:
            cache.index_copy_(0, dst, cache.index_select(0, src))

    def zero_blocks(self, block_ids: Sequence[int]) -> None:
        """Zero the given blocks in every layer."""
        if not block_ids:
            return
        ids = torch.tensor(list(block_ids), dtype=torch.long)
        for cache in self.layers:
            cache.index_fill_(0, ids, 0.0)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros from calloc (via numpy): the OS hands out zeroed pages as they are first touched,
    so a GiB pool costs nothing at start-up (torch.zeros writes every byte now)."""
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


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
