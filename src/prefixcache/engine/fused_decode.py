"""One sequence's forward, all layers in one native call (`kernels/decode_layer.cpp`).

The eager `DecoderLayer` runs ~25 torch ops per layer, and for a few tokens their Python and
dispatch overhead costs as much as the matmuls. When the model is fp32 on int4 or GGUF-block
weights (with an fp32, bf16 or int8 KV store), the native kernels load, and the batch is one
sequence adding at most `MAX_FUSED_ROWS` tokens (a decode step, or a short prompt or prompt
suffix), the layers run in one call instead: the same kernels for the projections (the same
numbers), norms, RoPE, the K/V stores (the paged pool in its dtype, and the sequence's
contiguous fp32 copy, `lone_decode.py`, holding the values as stored) and causal attention
in C++. Anything else takes the eager path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from prefixcache.engine import kernels
from prefixcache.engine.attention import AttentionMetadata
from prefixcache.engine.config import ModelConfig
from prefixcache.engine.kv_store import KVStore
from prefixcache.engine.quant import MAX_INT4_ROWS, Int4Linear
from prefixcache.engine.weight_types.linear import PackedLinear
from prefixcache.engine.weight_types.packed_weight import max_decode_rows

if TYPE_CHECKING:
    from prefixcache.engine.models.llama import LlamaModel

_PROJECTIONS = ("qkv", "o", "gate_up", "down")
# The eager path runs up to this many rows on the int4 kernel (more on the dense matmul): the
# fused path takes the same, so both compute a chunk's projections with the same kernel.
MAX_FUSED_ROWS = MAX_INT4_ROWS
FUSED_KV_DTYPES = (torch.float32, torch.bfloat16, torch.int8)  # pools the kernel writes


def fused_supported(config: ModelConfig) -> bool:
    """Whether the fused kernel knows this model's layers (a plain Llama: no bias, no
    QK-norm, no sliding window)."""
    return (
        config.architecture == "llama"
        and not config.attention_bias
        and not config.qk_norm
        and not config.sliding_window
    )


def projections(model: LlamaModel) -> tuple[object, ...]:
    """Every layer's projections (qkv, o, gate_up, down), layer by layer."""
    return tuple(getattr(layer, p) for layer in model.layers for p in _PROJECTIONS)


def fused_applies(model: LlamaModel, kv_store: KVStore) -> bool:
    """Whether this model and store can decode on the fused layers."""
    return (
        fused_supported(model.config)
        and model.dtype == torch.float32
        and kv_store.dtype in FUSED_KV_DTYPES
        and all(isinstance(p, Int4Linear | PackedLinear) for p in projections(model))
        and kernels.available()
    )


def fused_decode(
    model: LlamaModel,
    h: torch.Tensor,
    positions: torch.Tensor,
    metadata: AttentionMetadata,
    kv_store: KVStore,
) -> torch.Tensor:
    """Run every layer on the new tokens' residual stream `h` `[T, hidden]`, in place."""
    lone, first = model.lone, model.layers[0]
    cos, sin = (t.reshape(len(positions), -1) for t in model.rotary(positions, torch.float32))
    rows = kv_store.rows_of(metadata.slot_mapping)
    lone.refill(kv_store.layers)
    w = _weights(model)
    torch.ops.prefixcache.decode_layers(
        h, w.norms, w.packed, w.pairs, w.types, cos, sin, lone.keys, lone.values,
        kv_store.layers, lone.length, rows, first.num_heads, first.num_kv_heads, first.eps,
        first.scale, max_decode_rows(),
    )  # fmt: skip
    return h


Projection = Int4Linear | PackedLinear
_NO_PAIRS = torch.empty(0, dtype=torch.bfloat16)  # a GGUF projection's unused scale pairs


class FusedWeights:
    """Per layer, its 2 norms and its 4 projections (int4: packed codes and scale/zero pairs,
    type -1; GGUF: its blocks and type), as the flat lists the op takes; with what they were
    built from, to notice a change."""

    __slots__ = ("linears", "norm_pointers", "norms", "packed", "pairs", "types")

    def __init__(self, linears: tuple[Projection, ...], norms: list[torch.Tensor]) -> None:
        self.linears = linears
        self.norm_pointers = [n.data_ptr() for n in norms]
        self.norms = norms
        parts = [_op_parts(linear) for linear in linears]
        self.packed, self.pairs, self.types = (list(column) for column in zip(*parts, strict=True))

    def built_from(self, linears: tuple[Projection, ...], norms: list[torch.Tensor]) -> bool:
        return (
            len(linears) == len(self.linears)
            and all(a is b for a, b in zip(linears, self.linears, strict=True))
            and [n.data_ptr() for n in norms] == self.norm_pointers
        )


def _op_parts(linear: Projection) -> tuple[torch.Tensor, torch.Tensor, int]:
    """What the op takes of one projection: its codes, its scale pairs and its GGML type."""
    if isinstance(linear, PackedLinear):
        return linear.weight.blocks, _NO_PAIRS, linear.weight.wtype.code
    return linear.packed, linear.scales_and_zeros, -1


def _weights(model: LlamaModel) -> FusedWeights:
    """The model's `FusedWeights`, built once, and again if a layer's weights were replaced."""
    linears = projections(model)
    norms = [
        n.data
        for layer in model.layers
        for n in (layer.input_layernorm, layer.post_attention_layernorm)
    ]
    if model.fused_weights is None or not model.fused_weights.built_from(linears, norms):
        model.fused_weights = FusedWeights(linears, norms)
    return model.fused_weights
