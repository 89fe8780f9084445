"""GGUF weight types kept in the file's own blocks, with their native kernels.

`PackedWeight` holds an `[out, in]` matrix as the GGUF stores it (F32, F16, BF16, Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K); `kernels/gguf_blocks.h` decodes each type's
blocks and `kernels/gguf_matmul.cpp` multiplies by them.
"""

from prefixcache.engine.weight_types.formats import (
    WEIGHT_TYPES,
    WEIGHT_TYPES_BY_NAME,
    WeightType,
    weight_type,
)
from prefixcache.engine.weight_types.packed_weight import PackedWeight

__all__ = ["WEIGHT_TYPES", "WEIGHT_TYPES_BY_NAME", "PackedWeight", "WeightType", "weight_type"]
