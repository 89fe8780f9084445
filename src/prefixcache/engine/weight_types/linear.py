"""Projections on `PackedWeight` matrices: what a model layer calls for a GGUF's non-Q4 types.

A fused projection (q|k|v, gate|up) whose parts share a type is one matrix; parts of
different types (Gemma 3's Q5_0 q and k beside a Q8_0 v) are multiplied one run of equal
types at a time and their outputs concatenated.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import groupby

import torch

from prefixcache.engine.weight_types.packed_weight import PackedWeight


class PackedLinear:
    """`y = x W^T` on one packed matrix (fp32 in and out: `PackedWeight.matmul`'s contract)."""

    __slots__ = ("weight", "out_features")

    def __init__(self, weight: PackedWeight) -> None:
        self.weight = weight
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight.matmul(x.float().contiguous()).to(x.dtype)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes


class ConcatLinear:
    """Outputs of several packed projections side by side: one fused projection."""

    __slots__ = ("parts", "out_features")

    def __init__(self, parts: Sequence[PackedLinear]) -> None:
        self.parts = tuple(parts)
        self.out_features = sum(p.out_features for p in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


def packed_linear(parts: Sequence[PackedWeight]) -> PackedLinear | ConcatLinear:
    """The fused projection of `parts` (rows in order): one matrix per run of one type."""
    runs = [PackedWeight.cat(list(run)) for _, run in groupby(parts, key=lambda p: p.wtype)]
    linears = [PackedLinear(run) for run in runs]
    return linears[0] if len(linears) == 1 else ConcatLinear(linears)
