"""A GGUF's weights by Hugging Face name, its packed tensors dequantized only when read.

A model that runs a tensor on its file's blocks never reads its dense copy, so a load that
packs first (Gemma 3) dequantizes none of them: no time and no transient fp32 copy.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from prefixcache.engine.weight_types import PackedWeight


class PackedStateDict(Mapping[str, torch.Tensor]):
    """HF name -> tensor: dense ones as they are, packed ones dequantized (bit-exact) per read."""

    def __init__(self, dense: Mapping[str, torch.Tensor], packed: Mapping[str, PackedWeight]):
        self.dense, self.packed = dict(dense), dict(packed)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.packed:
            return self.packed[name].dequantize()
        return self.dense[name]

    def __iter__(self) -> Iterator[str]:
        yield from self.dense
        yield from (name for name in self.packed if name not in self.dense)

    def __len__(self) -> int:
        return len(self.dense.keys() | self.packed.keys())

    def __contains__(self, name: object) -> bool:
        return name in self.dense or name in self.packed


def tensor_shapes(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape, without dequantizing a packed one."""
    if isinstance(state, PackedStateDict):
        packed = {name: tuple(weight.shape) for name, weight in state.packed.items()}
        return {**packed, **{name: tuple(t.shape) for name, t in state.dense.items()}}
    return {name: tuple(t.shape) for name, t in state.items()}
