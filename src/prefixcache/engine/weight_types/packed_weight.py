"""`PackedWeight`: an `[out, in]` matrix resident in its GGUF's own block bytes.

Resident bytes are the file's bytes: a uint8 tensor `[out, row bytes]`, rows of blocks. The
native kernels (`kernels/gguf_matmul.cpp`) decode it on the fly; their contract: every weight
takes exactly its dequantized fp32 value, activations stay fp32, products and sums are fp32,
so `matmul(x)` equals `x @ dequantize().T` up to the order of the fp32 sums. Without the native
kernels, dequantization falls back to gguf-py's (the reference) and matmul to `F.linear`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from prefixcache.engine import kernels
from prefixcache.engine.anonymous_memory import anonymous_zeros
from prefixcache.engine.weight_types.formats import WeightType, weight_type


class RowLimits(NamedTuple):
    """Which kernel a product of T activation rows takes: the decode kernel for T <= `decode`
    (8 rows a pass, each pass decoding the weights again), the panel kernel for T <= `panel`
    (`kernels/gguf_panel.h`: each weight decoded once into a cached panel), else sgemm on the
    matrix decoded whole into fp32."""

    decode: int
    panel: int


# Where the kernels cross depends on the vector unit (`kernels.decoders()`). Measured on a
# stack of a model's layers (30 SmolLM2-shaped Q4_1 ones, or 18 Gemma-shaped Q5_0/Q4_K/Q6_K),
# ms a pass, decode / panel / sgemm, weights cold:
# - AVX-512 (a 2-core KVM Xeon with AMX): 16 rows 20.3 / 21.9 / 33.9, 17 rows 23.6 / 21.2 /
#   35.4, 24 rows 30.9 / 29.7 / 38.9, 33 rows 44.5 / 30.8 / 48.6, 97 rows 128 / 74 / 83,
#   192 rows 212 / 131 / 143, 256 rows - / 172 / 167.
# - AVX2 (the same Xeon, kernels built with -mno-avx512f; its sgemm kept AVX-512, so that
#   column is not an AVX2 machine's): 12 rows 23.0 / 25.5, 16 rows 27.5 / 26.0, 33 rows
#   58.8 / 43.6, 128 rows 214 / 141. On an AMD EPYC (Zen 3, AVX2 only) the decode kernel
#   beat sgemm up to ~128 rows (decoding a whole SmolLM2 layer into fp32 cost ~2.5 ms
#   there), so the panel kernel, 1.5x the decode kernel's speed at 128 rows, keeps that
#   limit; not measured on the EPYC.
# - The portable decoders: no panel kernel, sgemm past 32 rows.
ROW_LIMITS = {
    "avx512": RowLimits(decode=16, panel=192),
    "avx2": RowLimits(decode=12, panel=128),
    "portable": RowLimits(decode=32, panel=32),
}


def row_limits() -> RowLimits:
    """The kernels' row limits on this CPU (the eager and fused paths share them)."""
    return ROW_LIMITS[kernels.decoders() if kernels.available() else "portable"]


class PackedWeight:
    """A matrix in GGUF blocks: `matmul`, `dequantize`, `dequantize_rows`, `take_rows`, `cat`."""

    __slots__ = ("blocks", "wtype", "shape", "name")

    def __init__(self, blocks: torch.Tensor, wtype: WeightType, shape: tuple[int, int], name: str):
        self.blocks = blocks  # uint8 [out, row bytes], contiguous
        self.wtype = wtype
        self.shape = shape  # (out, in)
        self.name = name

    @classmethod
    def from_gguf(
        cls, raw: np.ndarray, ggml_type: int, shape: Sequence[int], name: str = "tensor"
    ) -> PackedWeight:
        """A copy of a GGUF tensor's bytes (any dtype numpy view of them, e.g.
        `GGUFReader`'s `tensor.data`) as the `[out, in]` matrix `shape`."""
        wtype = weight_type(ggml_type, name)
        out, num_in = _checked_shape(shape, wtype, name)
        data = np.asarray(raw).reshape(-1).view(np.uint8)
        expected = out * wtype.row_bytes(num_in)
        if data.size != expected:
            raise ValueError(
                f"{name}: {data.size} bytes, but {wtype.name} [{out}, {num_in}] needs {expected}"
            )
        blocks = anonymous_zeros((out, wtype.row_bytes(num_in)), torch.uint8)
        blocks.numpy()[...] = data.reshape(out, -1)  # no huge-page advice: anonymous_memory
        return cls(blocks, wtype, (out, num_in), name)

    @property
    def nbytes(self) -> int:
        """Resident bytes: the GGUF's bytes of this matrix."""
        return self.blocks.numel()

    def dequantize(self) -> torch.Tensor:
        """The fp32 `[out, in]` matrix, bit for bit as `gguf.quants.dequantize`."""
        return _dequantize(self.blocks, self.wtype, self.shape[1])

    def dequantize_rows(self, ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """Rows `ids` in fp32, `[*ids.shape, in]` (an embedding lookup, no dense copy)."""
        index = self._index(ids, "row id")
        rows = _dequantize(self.blocks[index.reshape(-1)], self.wtype, self.shape[1])
        return rows.view(*index.shape, self.shape[1])

    def take_rows(self, order: torch.Tensor | Sequence[int]) -> PackedWeight:
        """The rows in `order` (llama.cpp's Q/K row interleave undone by the loader)."""
        index = self._index(order, "row order entry").reshape(-1)
        return PackedWeight(self.blocks[index], self.wtype, (len(index), self.shape[1]), self.name)

    @staticmethod
    def cat(parts: Sequence[PackedWeight]) -> PackedWeight:
        """The parts' rows one after another (fused q|k|v, gate|up): same type and `in`."""
        if not parts:
            raise ValueError("cat needs at least one part")
        first = parts[0]
        for part in parts[1:]:
            if part.wtype != first.wtype or part.shape[1] != first.shape[1]:
                raise ValueError(
                    f"cannot concatenate {part.name} ({part.wtype.name} [{part.shape[0]}, "
                    f"{part.shape[1]}]) after {first.name} ({first.wtype.name} [{first.shape[0]}, "
                    f"{first.shape[1]}]): parts need the same type and in_features"
                )
        blocks = torch.cat([p.blocks for p in parts])
        name = "|".join(p.name for p in parts)
        return PackedWeight(blocks, first.wtype, (blocks.shape[0], first.shape[1]), name)

    def matmul(self, x: torch.Tensor, activation_bits: int = 32) -> torch.Tensor:
        """`x @ W^T` for fp32 `x` `[T, in]` -> fp32 `[T, out]` (the module docstring's contract;
        with `activation_bits` 16 or 8, rows the decode kernel takes meet the weights as integer
        codes, `kernels/gguf_int8.h`'s contract, where the type has that kernel)."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.shape[1]:
            raise ValueError(
                f"{self.name}: matmul takes fp32 [tokens, {self.shape[1]}], "
                f"got {x.dtype} {list(x.shape)}"
            )
        if self.wtype.name == "F32":
            return F.linear(x, self.blocks.view(torch.float32))
        if kernels.available():
            return torch.ops.prefixcache.gguf_matmul(
                x.contiguous(), self.blocks, self.wtype.code, self.shape[1], *row_limits(),
                activation_bits,
            )  # fmt: skip
        return F.linear(x, self.dequantize())

    def _index(self, ids: torch.Tensor | Sequence[int], what: str) -> torch.Tensor:
        """`ids` as int64, each checked to be a row of this matrix."""
        index = torch.as_tensor(ids)
        if index.numel() == 0:
            index = index.long()
        if index.dtype.is_floating_point or index.dtype == torch.bool:
            raise ValueError(f"{self.name}: {what}s must be integers, got {index.dtype}")
        index = index.long()
        if index.numel():  # one reduction for both ends (an embedding lookup every step)
            low, high = (int(end) for end in torch.aminmax(index))
            if low < 0 or high >= self.shape[0]:
                bad = low if low < 0 else high
                raise ValueError(f"{self.name}: {what} {bad} is outside 0..{self.shape[0] - 1}")
        return index


def _checked_shape(shape: Sequence[int], wtype: WeightType, name: str) -> tuple[int, int]:
    """`(out, in)`, both positive, `in` a whole number of blocks."""
    dims = tuple(int(d) for d in shape)
    if len(dims) != 2 or min(dims) <= 0:
        raise ValueError(f"{name}: shape {list(dims)} is not a matrix [out, in] with out, in >= 1")
    if dims[1] % wtype.block_values:
        raise ValueError(
            f"{name}: in_features {dims[1]} is not a multiple of {wtype.name}'s block of "
            f"{wtype.block_values} values"
        )
    return dims


def _dequantize(blocks: torch.Tensor, wtype: WeightType, num_in: int) -> torch.Tensor:
    """Rows of blocks as fp32 `[rows, in]`: the native decoder, else gguf-py's."""
    if kernels.available():
        return torch.ops.prefixcache.gguf_dequantize(blocks, wtype.code, num_in)
    qtype = gguf.GGMLQuantizationType(wtype.code)
    values = gguf.quants.dequantize(blocks.numpy(), qtype)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(-1, num_in))
