"""What a model family tells the loader: its GGUF tensor names, its config fields, its class.

One `Family` per architecture, declared in that family's file (`engine/models/*.py`); the
loader (`engine/weights.py`) and the engine only ever go through it, so nothing above the
model layer branches on an architecture's name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from prefixcache.engine.model_files import ModelFileError

# GGUF per-layer tensor -> HF name suffix, shared by every family here ("blk.{i}." prefix).
BASE_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
QK_NORM_NAMES = {
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}

ConfigFields = Callable[["GgufFields"], dict[str, Any]]


@dataclass(frozen=True, slots=True)
class GgufFields:
    """A GGUF's metadata and tensors, read under one architecture's key prefix."""

    meta: Mapping[str, Any]
    tensors: Mapping[str, Any]
    arch: str
    path: Path

    def get(self, key: str, default: Any = None) -> Any:
        """`{arch}.{key}`, or `default`."""
        return self.meta.get(f"{self.arch}.{key}", default)

    def number(self, key: str, kind: type = int) -> Any:
        """A required positive scalar `{arch}.{key}`; ModelFileError naming it otherwise."""
        value = self.get(key)
        if value is None or isinstance(value, list | str) or not value > 0:
            raise ModelFileError(
                f"{self.path}: metadata {self.arch}.{key} is missing or not a positive number"
            )
        return kind(value)

    def vector(self, name: str) -> np.ndarray | None:
        """A small F32 tensor's values (e.g. `rope_freqs.weight`), or None if absent."""
        tensor = self.tensors.get(name)
        if tensor is None:
            return None
        if int(tensor.tensor_type) != 0:  # F32
            kind = getattr(tensor.tensor_type, "name", tensor.tensor_type)
            raise ModelFileError(f"{self.path}: tensor {name} has type {kind}, expected F32")
        return np.asarray(tensor.data, dtype=np.float32).reshape(-1)


@dataclass(frozen=True, slots=True)
class Family:
    """One architecture: its model class and how its GGUF files name and describe it."""

    architecture: str
    model: Callable[..., nn.Module]  # (config, dtype=..., device=...) -> the model
    layer_names: Mapping[str, str]  # GGUF "blk.{i}." suffix -> HF "model.layers.{i}." suffix
    config_fields: ConfigFields = lambda fields: {}
    # llama.cpp's converter interleaves Q/K rows for Llama's RoPE; the loader undoes it.
    permuted_qk: bool = False
    consumed: frozenset[str] = field(default_factory=frozenset)  # read into the config
