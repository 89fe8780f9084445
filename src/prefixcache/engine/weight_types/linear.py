"""Projections on `PackedWeight` matrices: what a model layer calls for a GGUF's non-Q4 types.

A fused projection (q|k|v, gate|up) whose parts share a type is one matrix; parts of
different types (Gemma 3's Q5_0 q and k beside a Q8_0 v) are multiplied one run of equal
types at a time and their outputs concatenated.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import groupby

import torch

from prefixcache.engine.config import ACTIVATION_BITS, DECODE_ACTIVATIONS
from prefixcache.engine.weight_types.packed_weight import PackedWeight


class PackedLinear:
    """`y = x W^T` on one packed matrix (fp32 in and out: `PackedWeight.matmul`'s contract,
    with integer activations in the decode kernel once `activation_bits` is 16 or 8)."""

    __slots__ = ("weight", "out_features", "activation_bits")

    def __init__(self, weight: PackedWeight) -> None:
        self.weight = weight
        self.out_features = weight.shape[0]
        self.activation_bits = 32

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.weight.matmul(x.float().contiguous(), activation_bits=self.activation_bits)
        return y.to(x.dtype)

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


def packed_parts(linear: object) -> tuple[object, ...]:
    """A projection's parts: a `ConcatLinear`'s, else the projection itself."""
    return linear.parts if isinstance(linear, ConcatLinear) else (linear,)


def set_decode_activations(modules: Iterable[object], activations: str) -> None:
    """Every packed projection among `modules`' attributes (a model and its layers) runs its
    decode kernel on `activations` ("fp32": exact; "int16", "int8": `kernels/gguf_int8.h`)."""
    if activations not in DECODE_ACTIVATIONS:
        raise ValueError(
            f"decode_activations {activations!r} is not one of {', '.join(DECODE_ACTIVATIONS)}"
        )
    for module in modules:
        for value in vars(module).values():
            for part in packed_parts(value):
                if isinstance(part, PackedLinear):
                    part.activation_bits = ACTIVATION_BITS[activations]


def activation_bits(linear: object) -> int:
    """The bits of a projection's decode-kernel activations (`set_decode_activations`): 32
    for fp32 (and for a projection with no packed part)."""
    return min((p.activation_bits for p in packed_parts(linear) if isinstance(p, PackedLinear)),
               default=32)  # fmt: skip
