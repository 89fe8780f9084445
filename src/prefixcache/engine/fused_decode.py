"""One sequence's forward, all layers in one native call (`kernels/decode_layer.cpp`).

The eager layers (`DecoderLayer`, `Gemma3Layer`) run ~25-35 torch ops each, and for a few
tokens their Python and dispatch overhead costs as much as the matmuls. When the model is
fp32 on int4 or GGUF-block weights (with an fp32, bf16 or int8 KV store), the native kernels
load, and the batch is one sequence adding at most `MAX_FUSED_ROWS` tokens (a decode step,
or a short prompt or prompt suffix), the layers run in one call instead: the same kernels for
the projections (the same numbers), norms, RoPE, the K/V stores (the paged pool in its dtype,
and the sequence's contiguous fp32 copy, `lone_decode.py`, holding the values as stored) and
causal attention in C++. Each layer reads and writes through its KV group's view of the batch
(`AttentionMetadata.for_group`): a window layer attends to its window, and in a hybrid pool
keeps its K/V in its own pages. Anything else takes the eager path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from prefixcache.engine import kernels
from prefixcache.engine.attention import AttentionMetadata
from prefixcache.engine.config import ModelConfig
from prefixcache.engine.kv_store import KVStore
from prefixcache.engine.quant import MAX_INT4_ROWS, Int4Linear
from prefixcache.engine.weight_types.linear import ConcatLinear, PackedLinear, activation_bits
from prefixcache.engine.weight_types.packed_weight import row_limits

if TYPE_CHECKING:
    from prefixcache.engine.models.gemma3 import Gemma3Model
    from prefixcache.engine.models.llama import LlamaModel

    FusedModel = LlamaModel | Gemma3Model

_PROJECTIONS = ("qkv", "o", "gate_up", "down")
# The eager path runs up to this many rows on the int4 kernel (more on the dense matmul): the
# fused path takes the same, so both compute a chunk's projections with the same kernel.
MAX_FUSED_ROWS = MAX_INT4_ROWS
FUSED_KV_DTYPES = (torch.float32, torch.bfloat16, torch.int8)  # pools the kernel writes


def fused_supported(config: ModelConfig) -> bool:
    """Whether the fused kernel knows this model's layers: Llama's (with Qwen 2's q|k|v bias
    or Qwen 3's QK-norms) and Gemma 3's (QK-norms, sandwich norms, GeGLU, windows with their
    own RoPE); not a window on a Llama-family layer."""
    if config.architecture == "gemma3":
        return True
    return config.architecture in ("llama", "qwen2", "qwen3") and not config.sliding_window


def projections(model: FusedModel) -> tuple[object, ...]:
    """Every layer's projections (qkv, o, gate_up, down), layer by layer."""
    return tuple(getattr(layer, p) for layer in model.layers for p in _PROJECTIONS)


def fused_applies(model: FusedModel, kv_store: KVStore) -> bool:
    """Whether this model and store can decode on the fused layers."""
    return (
        fused_supported(model.config)
        and model.dtype == torch.float32
        and kv_store.dtype in FUSED_KV_DTYPES
        and kernels.available()
        and _weights(model) is not None
    )


def fused_decode(
    model: FusedModel,
    h: torch.Tensor,
    positions: torch.Tensor,
    metadata: AttentionMetadata,
    kv_store: KVStore,
) -> torch.Tensor:
    """Run every layer on the new tokens' residual stream `h` `[T, hidden]`, in place."""
    lone, first = model.lone, model.layers[0]
    tables = [t.reshape(len(positions), -1) for t in model.rope_tables(positions)]
    layers = zip(kv_store.groups, model.layers, strict=True)
    views = [metadata.for_group(group, layer.window) for group, layer in layers]
    lone.refill(kv_store.layers, views)
    rows = [kv_store.rows_of(view.slot_mapping) for view in views]  # memoized per mapping
    w = _weights(model)
    assert w is not None, "fused_decode on a model fused_applies refuses"
    torch.ops.prefixcache.decode_layers(
        h, w.norms, w.packed, w.pairs, w.types, w.counts, w.biases, *tables, w.windows, lone.keys,
        lone.values, kv_store.layers, lone.length, rows, first.num_heads, first.num_kv_heads,
        first.eps, first.scale, w.gelu, *row_limits(), activation_bits(first.qkv),
    )  # fmt: skip
    return h


Projection = Int4Linear | PackedLinear | ConcatLinear
_NO_PAIRS = torch.empty(0, dtype=torch.bfloat16)  # a GGUF projection's unused scale pairs
_NO_BIAS = torch.empty(0)  # a layer without a q|k|v bias


class FusedWeights:
    """Per layer, its norms (`fused_norms`) and its 4 projections, each of one or more parts
    (int4: packed codes and scale/zero pairs, type -1; GGUF: its blocks and type), its q|k|v
    bias (empty: none) and its window, as the flat lists the op takes. Built on a model's
    first fused forward and kept (`model.fused_weights`): whoever replaces a model's weights
    afterwards sets that back to None (`LLMEngine` does for the model it is given)."""

    __slots__ = ("biases", "counts", "gelu", "norms", "packed", "pairs", "types", "windows")

    def __init__(
        self,
        linears: tuple[Projection, ...],
        norms: list[torch.Tensor],
        windows: list[int] | None = None,
        gelu: bool = False,
        biases: list[torch.Tensor | None] | None = None,
    ) -> None:
        self.norms = norms
        self.windows = windows if windows is not None else [0] * (len(linears) // 4)
        self.gelu = gelu
        layers = len(self.windows)
        self.biases = [_NO_BIAS if b is None else b.data for b in biases or [None] * layers]
        parts = [_parts(linear) for linear in linears]
        self.counts = [len(p) for p in parts]
        flat = [part for p in parts for part in p]
        self.packed, self.pairs, self.types = (list(column) for column in zip(*flat, strict=True))


def _parts(linear: Projection) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """What the op takes of one projection, part by part: codes, scale pairs, GGML type."""
    if isinstance(linear, ConcatLinear):
        return [part for p in linear.parts for part in _parts(p)]
    if isinstance(linear, PackedLinear):
        return [(linear.weight.blocks, _NO_PAIRS, linear.weight.wtype.code)]
    return [(linear.packed, linear.scales_and_zeros, -1)]


def _weights(model: FusedModel) -> FusedWeights | None:
    """The model's `FusedWeights`, built on first use (checking the model every step took
    ~150 us of a 7 ms SmolLM2 decode step); None while a projection has no fused kernel."""
    if model.fused_weights is None:
        linears = projections(model)
        if not all(isinstance(p, Projection) for p in linears):
            return None
        norms = [n.data for layer in model.layers for n in layer.fused_norms()]
        windows = [layer.window for layer in model.layers]
        biases = [layer.qkv_bias for layer in model.layers]
        model.fused_weights = FusedWeights(linears, norms, windows, model.gated_by_gelu, biases)
    return model.fused_weights
