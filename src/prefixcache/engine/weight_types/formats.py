"""The GGML weight types `PackedWeight` holds: each one's code, name and block size."""

from __future__ import annotations

from dataclasses import dataclass

import gguf


@dataclass(frozen=True, slots=True)
class WeightType:
    """A GGML tensor type: `block_values` weights in every `block_bytes` bytes."""

    code: int  # gguf.GGMLQuantizationType value
    name: str
    block_values: int
    block_bytes: int
    scale_offsets: tuple[int, ...]  # where each block's fp16 scales (and minimums) sit

    def row_bytes(self, num_in: int) -> int:
        """Bytes of one row of `num_in` weights (a whole number of blocks)."""
        return num_in // self.block_values * self.block_bytes


# Each type by name, with the byte offsets of its blocks' fp16 scale fields.
_SCALE_OFFSETS: dict[str, tuple[int, ...]] = {
    "F32": (), "F16": (), "BF16": (),
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}  # fmt: skip


def _weight_type(name: str) -> WeightType:
    code = gguf.GGMLQuantizationType[name]
    values, nbytes = gguf.GGML_QUANT_SIZES[code]
    return WeightType(int(code), name, values, nbytes, _SCALE_OFFSETS[name])


WEIGHT_TYPES: dict[int, WeightType] = {t.code: t for t in map(_weight_type, _SCALE_OFFSETS)}
WEIGHT_TYPES_BY_NAME: dict[str, WeightType] = {t.name: t for t in WEIGHT_TYPES.values()}


def weight_type(ggml_type: int, tensor: str = "tensor") -> WeightType:
    """The `WeightType` of a GGML type code; a ValueError naming the tensor and the type if
    it is not one of `WEIGHT_TYPES`."""
    found = WEIGHT_TYPES.get(int(ggml_type))
    if found is None:
        try:
            name = gguf.GGMLQuantizationType(int(ggml_type)).name
        except ValueError:
            name = "unknown"
        supported = ", ".join(t.name for t in WEIGHT_TYPES.values())
        message = f"GGML type {int(ggml_type)} ({name}) is not supported (supported: {supported})"
        raise ValueError(f"{tensor}: {message}")
    return found
