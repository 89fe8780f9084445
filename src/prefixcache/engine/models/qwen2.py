"""Qwen 2 / 2.5: the Llama layers with a bias on q, k and v (`models/llama.py` runs them)."""

from __future__ import annotations

from prefixcache.engine.models.family import Family, GgufFields
from prefixcache.engine.models.llama import LLAMA_LAYER_NAMES, LlamaModel

_BIASES = {f"attn_{p}.bias": f"self_attn.{p}_proj.bias" for p in "qkv"}


def _qwen2_fields(fields: GgufFields) -> dict[str, object]:
    """Every Qwen 2 attention has q/k/v biases."""
    return {"attention_bias": True}


QWEN2 = Family("qwen2", LlamaModel, {**LLAMA_LAYER_NAMES, **_BIASES}, _qwen2_fields)
