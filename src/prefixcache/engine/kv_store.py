"""Physical paged KV memory: one tensor per layer, addressed by block ids from the cache core."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np
import torch

from prefixcache.engine.config import ModelConfig


class KVStore:
    """Per-layer `[num_blocks, 2, block_size, num_kv_heads, head_dim]` tensors (0 = K, 1 = V).

    A token at position p of a sequence lives at slot `block_table[p // block_size] *
    block_size + p % block_size`; `write` takes those slots, attention reads whole blocks.
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
        self.dtype = dtype
        shape = (num_blocks, 2, block_size, num_kv_heads, head_dim)
        self.layers: list[torch.Tensor] = [_zeros(shape, dtype) for _ in range(num_layers)]
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
        itemsize = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * block_size * num_kv_heads * head_dim * itemsize

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block across all layers: `[num_layers, 2, block_size, kv_heads, head_dim]`."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    def read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A copy of the given blocks, `[n, *block_shape]` (safe after the slots are reused)."""
        ids = torch.tensor(list(block_ids), dtype=torch.long)
        return torch.stack([layer.index_select(0, ids) for layer in self.layers], dim=1)

    def write_block(self, block_id: int, payload: memoryview | bytes) -> None:
        """Fill one block in every layer from `block_shape` values in this store's dtype."""
        with warnings.catch_warnings():  # a read-only buffer is fine: it is only copied from
            warnings.simplefilter("ignore", UserWarning)
            values = torch.frombuffer(payload, dtype=self.dtype).view(self.block_shape)
        for layer, value in zip(self.layers, values, strict=True):
            layer[block_id].copy_(value)

    @property
    def nbytes(self) -> int:
        """Total bytes held by the store."""
        return sum(t.numel() * t.element_size() for t in self.layers)

    def write(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Store `k`, `v` (`[T, kv_heads, head_dim]`) of T tokens at their slots (`[T]`)."""
        k_rows, v_rows = self._rows(slot_mapping)
        flat = self.layers[layer].view(-1, self.num_kv_heads, self.head_dim)
        flat.index_copy_(0, k_rows, k.to(self.dtype))
        flat.index_copy_(0, v_rows, v.to(self.dtype))

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
