"""A lone decode's layers as one native call each (`kernels/decode_layer.cpp`).

The eager `DecoderLayer` runs ~25 torch ops per layer, and for one token their Python and
dispatch overhead costs as much as the matmuls. When the model is fp32 on int4 weights with
an fp32 KV store, and the native kernels load, a lone decode (`lone_decode.py`) runs each
layer in one call instead: the same int4 kernel for the projections (the same numbers), the
norms, RoPE, the K/V stores (lone copy and paged pool) and attention in C++. Anything else
takes the eager path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from prefixcache.engine import kernels
from prefixcache.engine.attention import AttentionMetadata
from prefixcache.engine.kv_store import KVStore
from prefixcache.engine.quant import Int4Linear

if TYPE_CHECKING:
    from prefixcache.engine.model import LlamaModel

_PROJECTIONS = ("qkv", "o", "gate_up", "down")


def fused_applies(model: LlamaModel, kv_store: KVStore) -> bool:
    """Whether this model and store can decode on the fused layers."""
    return (
        model.dtype == torch.float32
        and kv_store.dtype == torch.float32
        and all(
            isinstance(getattr(layer, p), Int4Linear)
            for layer in model.layers
            for p in _PROJECTIONS
        )
        and kernels.available()
    )


def fused_decode(
    model: LlamaModel,
    h: torch.Tensor,
    positions: torch.Tensor,
    metadata: AttentionMetadata,
    kv_store: KVStore,
) -> torch.Tensor:
    """Run every layer on the lone decoding token's residual `h` `[1, hidden]`, in place."""
    lone, decode_layer = model.lone, torch.ops.prefixcache.decode_layer
    cos, sin = (t.reshape(-1) for t in model.rotary(positions, torch.float32))
    k_row, v_row = kv_store.rows_of(int(metadata.slot_mapping[0]))
    for i, layer in enumerate(model.layers):
        keys, values = lone.refill(i, kv_store.layers[i])
        linears = [getattr(layer, p) for p in _PROJECTIONS]
        decode_layer(
            h,
            layer.input_layernorm,
            layer.post_attention_layernorm,
            layer.eps,
            [linear.packed for linear in linears],
            [linear.scales_and_zeros for linear in linears],
            cos,
            sin,
            keys,
            values,
            lone.length,
            kv_store.layers[i],
            k_row,
            v_row,
            layer.num_heads,
            layer.scale,
        )
    return h
