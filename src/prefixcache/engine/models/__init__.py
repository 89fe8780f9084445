"""Model families, one file each (`llama.py`, `qwen2.py`, `qwen3.py`, `gemma3.py`).

`family(name)` is how the loader and the engine find one; `build_model` makes the model a
config describes. Nothing outside this package names an architecture.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from prefixcache.engine.config import ModelConfig
from prefixcache.engine.models.family import Family
from prefixcache.engine.models.gemma3 import GEMMA3
from prefixcache.engine.models.llama import LLAMA
from prefixcache.engine.models.qwen2 import QWEN2
from prefixcache.engine.models.qwen3 import QWEN3

FAMILIES: dict[str, Family] = {f.architecture: f for f in (LLAMA, QWEN2, QWEN3, GEMMA3)}
SUPPORTED_ARCHITECTURES = frozenset(FAMILIES)

log = logging.getLogger(__name__)


def family(architecture: str) -> Family | None:
    """The family of a GGUF `general.architecture` (or HF `model_type`), if we run it."""
    return FAMILIES.get(architecture)


def build_model(
    config: ModelConfig, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> nn.Module:
    """An uninitialised model of `config`'s family."""
    found = FAMILIES.get(config.architecture)
    if found is None:
        raise ValueError(f"architecture {config.architecture!r} is not supported")
    return found.model(config, dtype=dtype, device=device)
