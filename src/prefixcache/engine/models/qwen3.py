"""Qwen 3 (dense): the Llama layers with each query and key head RMS-normalised before RoPE."""

from __future__ import annotations

from prefixcache.engine.models.family import QK_NORM_NAMES, Family, GgufFields
from prefixcache.engine.models.llama import LLAMA_LAYER_NAMES, LlamaModel


def _qwen3_fields(fields: GgufFields) -> dict[str, object]:
    """Every Qwen 3 attention has QK-norm."""
    return {"qk_norm": True}


QWEN3 = Family("qwen3", LlamaModel, {**LLAMA_LAYER_NAMES, **QK_NORM_NAMES}, _qwen3_fields)
