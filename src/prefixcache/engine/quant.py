"""Weight-only int4 linear layers on a GGUF's own Q4_0/Q4_1 blocks, with torch's CPU kernel.

Q4_1 stores `w = d * q + m` per 32 inputs (Q4_0: `w = d * (q - 8)`), `q` in 0..15, which is
the group-wise int4 of torch's tinygemm kernel, `w = (q - 8) * scale + zero`, with
`scale = d`, `zero = m + 8d`. On x86 that kernel is vectorized for bfloat16 activations only
(fp32 takes a scalar loop 15x slower than a dense fp32 matmul), and it keeps scale and zero
in bfloat16. So one `Int4Linear` computes, whatever kernel runs it:

    y = bf16( bf16(x) @ W'^T ),  W' = (q - 8) * bf16(d) + bf16(m + 8d)  (exact in fp32),

accumulating in fp32. Few rows (decode) run the int4 kernel, which reads 0.625 bytes a
weight; many rows (prefill) run a dense fp32 matmul on `W'`, faster there. Both compute the
same products of the same numbers; only the order of the fp32 sums differs, as it does
between batch shapes of any dense matmul.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from prefixcache.engine import kernels
from prefixcache.engine.weight_types import PackedWeight

GROUP_SIZE = 32  # inputs per GGUF Q4 block, and the kernel's group size
KERNEL_DTYPE = torch.bfloat16
# Above this many rows the dense fp32 matmul on W' beats the int4 kernel (which redoes the
# dequantization for every 4 rows): see benchmarks/engine.py --kernels.
MAX_INT4_ROWS = 48
_Q4_0, _Q4_1, _Q8_0 = 2, 3, 8  # gguf.GGMLQuantizationType values
_BLOCK_BYTES = {_Q4_0: 18, _Q4_1: 20}


@dataclass(frozen=True, slots=True)
class Q4Blocks:
    """A `[out, in]` matrix as 4-bit codes with a scale and a minimum per 32 inputs."""

    codes: torch.Tensor  # [out, in] uint8 in 0..15
    scales: torch.Tensor  # [out, in // 32] float32 (the file's fp16 `d`)
    mins: torch.Tensor  # [out, in // 32] float32 (`m`; `-8d` for Q4_0)

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.codes.shape[0]), int(self.codes.shape[1]))

    def dequantize(self) -> torch.Tensor:
        """The matrix in fp32 exactly as the `gguf` package dequantizes it (`d * q + m`)."""
        out, num_in = self.shape
        codes = self.codes.view(out, -1, GROUP_SIZE).float()
        return (codes * self.scales[..., None] + self.mins[..., None]).view(out, num_in)

    def rows(self, order: np.ndarray | torch.Tensor) -> Q4Blocks:
        """The same blocks with rows reordered (llama.cpp's Q/K permutation undone)."""
        index = torch.as_tensor(order, dtype=torch.long)
        return Q4Blocks(self.codes[index], self.scales[index], self.mins[index])

    @staticmethod
    def cat(parts: Sequence[Q4Blocks]) -> Q4Blocks:
        """Row-wise concatenation: the blocks of a fused projection (q|k|v, gate|up)."""
        return Q4Blocks(
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scales for p in parts]),
            torch.cat([p.mins for p in parts]),
        )


@dataclass(frozen=True, slots=True)
class Q8Blocks:
    """A `[out, in]` Q8_0 matrix: `w = d * q`, `q` int8, one fp16 `d` per 32 inputs."""

    codes: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out, in // 32] float32

    def planes(self) -> Q4Blocks:
        """`q = 16 * hi + lo` as two int4 planes stacked row-wise, `[2 * out, in]`.

        `hi = q >> 4` in -8..7 is stored as code `hi + 8` with scale `16d`, minimum `-128d`;
        `lo = q & 15` in 0..15 with scale `d`, minimum 0: rows `n` and `out + n` sum to `w`.
        """
        hi, lo = (self.codes >> 4) + 8, self.codes & 15
        scales = torch.cat((16 * self.scales, self.scales))
        mins = torch.cat((-128 * self.scales, torch.zeros_like(self.scales)))
        return Q4Blocks(torch.cat((hi, lo)).to(torch.uint8), scales, mins)


def as_q4_blocks(packed: PackedWeight) -> Q4Blocks | None:
    """A Q4_0/Q4_1 `PackedWeight` as `Q4Blocks` (torch's int4 kernel); None for other types."""
    if not is_q4(packed.wtype.code):
        return None
    return q4_blocks(packed.blocks.numpy(), packed.wtype.code, packed.shape)


def as_q8_blocks(packed: PackedWeight) -> Q8Blocks | None:
    """A Q8_0 `PackedWeight` as `Q8Blocks` (for `Int4Head`'s planes); None for other types."""
    if packed.wtype.code != _Q8_0:
        return None
    return q8_blocks(packed.blocks.numpy(), packed.shape)


def q8_blocks(raw: np.ndarray, shape: tuple[int, int]) -> Q8Blocks:
    """Decode a GGUF Q8_0 tensor's bytes into `Q8Blocks` of HF shape `[out, in]`."""
    out, num_in = shape
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(out, num_in // GROUP_SIZE, 34)
    scales = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    codes = blocks[..., 2:].copy().view(np.int8).reshape(out, num_in)
    return Q8Blocks(torch.from_numpy(codes), torch.from_numpy(scales))


def is_q4(tensor_type: int) -> bool:
    """Whether a GGML tensor type maps onto `Q4Blocks` (Q4_0, Q4_1)."""
    return int(tensor_type) in _BLOCK_BYTES


def q4_blocks(raw: np.ndarray, tensor_type: int, shape: tuple[int, int]) -> Q4Blocks:
    """Decode a GGUF Q4_0/Q4_1 tensor's bytes into `Q4Blocks` of HF shape `[out, in]`."""
    kind = int(tensor_type)
    out, num_in = shape
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(out, num_in // GROUP_SIZE, -1)
    assert blocks.shape[-1] == _BLOCK_BYTES[kind], "unexpected Q4 block size"
    scales = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == _Q4_1:
        mins = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    else:
        mins = -8 * scales
    packed = blocks[..., -GROUP_SIZE // 2 :]  # byte j: element j (low), element j + 16 (high)
    codes = np.concatenate((packed & 15, packed >> 4), axis=-1).reshape(out, num_in)
    return Q4Blocks(torch.from_numpy(codes), torch.from_numpy(scales), torch.from_numpy(mins))


def can_pack(shape: tuple[int, int]) -> bool:
    """The kernel's limits: outputs in multiples of 16, inputs in whole groups."""
    out, num_in = shape
    return out % 16 == 0 and num_in % GROUP_SIZE == 0


def kernel_weight(blocks: Q4Blocks) -> torch.Tensor:
    """`W'`: the fp32 matrix the int4 kernel multiplies by (bf16 scale and zero, exact FMA)."""
    out = blocks.shape[0]
    scale, zero = _scale_and_zero(blocks)
    centred = blocks.codes.view(out, -1, GROUP_SIZE).float() - 8
    return (centred * scale.float()[..., None] + zero.float()[..., None]).view(out, -1)


def _scale_and_zero(blocks: Q4Blocks) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's bf16 `scale = d` and `zero = m + 8d`, `[out, groups]` each."""
    return blocks.scales.to(KERNEL_DTYPE), (blocks.mins + 8 * blocks.scales).to(KERNEL_DTYPE)


class Int4Linear:
    """`y = x W^T` on int4 weights (module docstring: the arithmetic, and which kernel).

    Without `dense`, there is no `W'` and every call runs the int4 kernel.
    """

    __slots__ = ("packed", "scales_and_zeros", "weight", "out_features")

    def __init__(self, blocks: Q4Blocks, dense: bool = True) -> None:
        assert can_pack(blocks.shape), f"cannot pack a {blocks.shape} matrix into int4"
        scale, zero = _scale_and_zero(blocks)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(blocks.codes.int(), 2)
        self.scales_and_zeros = torch.stack((scale, zero), -1).transpose(0, 1).contiguous()
        self.weight = kernel_weight(blocks) if dense else None
        self.out_features = blocks.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """`x` `[T, in]` in any float dtype -> `[T, out]` in the same dtype.

        The int4 kernel for up to `MAX_INT4_ROWS` rows, the dense one on `W'` for more (which
        rounds an fp32 `x` to bf16 in place: `rounded_dense_matmul`).
        """
        dense = self.weight is not None and x.shape[0] > MAX_INT4_ROWS
        if dense and x.dtype == torch.float32 and kernels.available():
            return rounded_dense_matmul(self, x)
        x16 = x.to(KERNEL_DTYPE).contiguous()
        return (dense_matmul if dense else int4_matmul)(self, x16).to(x.dtype)

    @property
    def nbytes_read(self) -> int:
        """Bytes the int4 kernel reads per call: packed codes and bf16 scale/zero pairs."""
        return _nbytes(self.packed) + _nbytes(self.scales_and_zeros)


def int4_matmul(linear: Int4Linear, x16: torch.Tensor) -> torch.Tensor:
    """`bf16(x16 @ W'^T)` with torch's int4 kernel (reads the packed codes)."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(
        x16, linear.packed, GROUP_SIZE, linear.scales_and_zeros
    )


def dense_matmul(linear: Int4Linear, x16: torch.Tensor) -> torch.Tensor:
    """`bf16(x16 @ W'^T)` with the dense fp32 matmul (reads W')."""
    assert linear.weight is not None
    return F.linear(x16.float(), linear.weight).to(KERNEL_DTYPE)


def rounded_dense_matmul(linear: Int4Linear, x: torch.Tensor) -> torch.Tensor:
    """`dense_matmul`'s numbers for fp32 `x`, in fp32: each bf16 rounding is one in-place
    native pass (`kernels/round_bf16.cpp`) instead of two casts, ~8% of a long prefill.

    Rounds a contiguous `x` in place: the model passes temporaries (a norm's output, the
    attention's, the gated activation)."""
    assert linear.weight is not None
    rounded = torch.ops.prefixcache.round_bf16_(x.contiguous())
    return torch.ops.prefixcache.round_bf16_(F.linear(rounded, linear.weight))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def weights_kernel(model: torch.nn.Module) -> str:
    """Which kernel the layers' quantized weights run on, a KV namespace field (the KV values
    differ): int4 if any projection is torch's int4 kernel (bf16 activations), else gguf."""
    layers = getattr(model, "layers", ())
    int4 = any(isinstance(v, Int4Linear) for layer in layers for v in vars(layer).values())
    return "int4" if int4 else "gguf"
