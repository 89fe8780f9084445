"""Valid random GGUF bytes of any weight type (tests and benchmarks: no file needed)."""

from __future__ import annotations

import numpy as np

from prefixcache.engine.weight_types.formats import WeightType


def random_blocks(wtype: WeightType, out: int, num_in: int, seed: int = 0) -> np.ndarray:
    """`[out, row bytes]` uint8: random codes with sane fp16 scales (~N(0, 0.01), 3% zero,
    3% subnormal), or random N(0, 1) values for the float types."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((out, num_in)).astype(np.float32)
    if wtype.name == "F32":
        return values.view(np.uint8)
    if wtype.name == "F16":
        return values.astype(np.float16).view(np.uint8)
    if wtype.name == "BF16":
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    blocks = num_in // wtype.block_values
    raw = rng.integers(0, 256, (out, blocks, wtype.block_bytes), dtype=np.uint8)
    for offset in wtype.scale_offsets:
        scales = (rng.standard_normal((out, blocks)) * 0.01).astype(np.float16)
        scales[rng.random((out, blocks)) < 0.03] = 0
        scales[rng.random((out, blocks)) < 0.03] = np.float16(3e-6)  # subnormal in fp16
        raw[..., offset : offset + 2] = scales.view(np.uint8).reshape(out, blocks, 2)
    return raw.reshape(out, -1)
