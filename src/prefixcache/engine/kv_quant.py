"""The int8 KV layout: each (token, KV head) row of `head_dim` values as int8 codes, then its
fp32 scale (absmax / 127), packed into `head_dim + 4` bytes of a uint8 tensor.

Packing code and scale side by side keeps one tensor per layer, so every block operation
(copy-on-write, zeroing, tier payloads) stays a plain byte copy; a zeroed row decodes to 0.
A value is off by at most half a step, absmax / 254, plus fp32 rounding. The fused kernel
(`kernels/decode_layer.cpp`) encodes with the same arithmetic, bit for bit.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # the fp32 scale after each row's codes
INV_127 = torch.tensor(1 / 127, dtype=torch.float32)  # scale = absmax * fp32(1/127)


def packed_width(head_dim: int) -> int:
    """Bytes of one packed row."""
    return head_dim + SCALE_BYTES


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows `[..., D]` as (packed `[..., D + 4]` uint8, int8 codes `[..., D]`, fp32 scales
    `[..., 1]`): codes = round(x / scale) with ties to even, scale = absmax(row) / 127."""
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True) * INV_127
    ratio = torch.where(scale > 0, x / scale, torch.zeros((), dtype=torch.float32))
    codes = ratio.round_().clamp_(-127, 127).to(torch.int8)
    packed = torch.empty((*x.shape[:-1], packed_width(x.shape[-1])), dtype=torch.uint8)
    packed[..., : x.shape[-1]] = codes.view(torch.uint8)
    packed[..., x.shape[-1] :] = scale.contiguous().view(torch.uint8)
    return packed, codes, scale


def dequantize_codes(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values of int8 `codes` `[..., D]` at their `scale` `[..., 1]`."""
    return codes.to(torch.float32) * scale


def dequantize_int8(packed: torch.Tensor) -> torch.Tensor:
    """fp32 rows `[..., D]` of packed rows `[..., D + 4]` (any strides)."""
    dim = packed.shape[-1] - SCALE_BYTES
    codes = packed[..., :dim].view(torch.int8)
    scale = packed[..., dim:].clone(memory_format=torch.contiguous_format).view(torch.float32)
    return dequantize_codes(codes, scale)
