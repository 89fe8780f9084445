"""Gemma 3 (text): QK-norm, pre- and post-norms around attention and MLP, GeGLU, a scaled
embedding, and sliding-window attention on 5 of every 6 layers with its own RoPE base.

The GGUF stores each RMSNorm's multiplier `1 + w` (llama.cpp's converter adds the 1), and
this model multiplies by it as stored. Window layers attend to the last `sliding_window`
positions (`AttentionMetadata.for_group`); in a hybrid KV layout (`kv_layout.py`) a window
layer keeps only its window's K/V, in its group's pages.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from prefixcache.engine.attention import AttentionMetadata, paged_attention
from prefixcache.engine.config import ModelConfig
from prefixcache.engine.fused_decode import (
    MAX_FUSED_ROWS,
    FusedWeights,
    fused_applies,
    fused_decode,
)
from prefixcache.engine.kv_store import KVStore
from prefixcache.engine.lone_decode import LoneDecode
from prefixcache.engine.model_files import ModelFileError
from prefixcache.engine.models.family import BASE_LAYER_NAMES, QK_NORM_NAMES, Family, GgufFields
from prefixcache.engine.models.llama import (
    DenseLinear,
    Linear,
    Rotary,
    _param,
    check_weights,
    copy_weights,
    projection_targets,
    quantize_projections,
    rms_norm,
    rotate_heads,
)
from prefixcache.engine.weight_types import PackedWeight
from prefixcache.engine.weight_types.linear import PackedLinear

# llama.cpp and transformers both fix these for Gemma 3 (the GGUF does not carry them).
SLIDING_WINDOW_PATTERN = 6  # layers 5, 11, 17, ... are full; the others window layers
LOCAL_ROPE_THETA = 10000.0

_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)


class Gemma3Layer(nn.Module):
    """One Gemma 3 block: normed attention and GeGLU MLP, each normed again before the add."""

    def __init__(self, config: ModelConfig, window: int, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        c = config
        param = partial(_param, dtype=dtype, device=device)
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.eps, self.scale, self.window = c.rms_norm_eps, c.scale, window
        self.qkv_bias = None  # Gemma 3 has none
        self.qkv_proj = param((c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.hidden_size)
        self.o_proj = param(c.hidden_size, c.num_heads * c.head_dim)
        self.gate_up_proj = param(2 * c.intermediate_size, c.hidden_size)
        self.down_proj = param(c.hidden_size, c.intermediate_size)
        for name in _NORMS:
            setattr(self, name, param(c.hidden_size))
        self.q_norm, self.k_norm = param(c.head_dim), param(c.head_dim)
        self.qkv: Linear = DenseLinear(self.qkv_proj)
        self.o: Linear = DenseLinear(self.o_proj)
        self.gate_up: Linear = DenseLinear(self.gate_up_proj)
        self.down: Linear = DenseLinear(self.down_proj)

    def fused_norms(self) -> list[torch.Tensor]:
        """The norms in the fused kernel's order: input, pre-MLP, the QK-norms, then those of
        the attention's and the MLP's outputs."""
        return [
            self.input_layernorm, self.pre_feedforward_layernorm, self.q_norm, self.k_norm,
            self.post_attention_layernorm, self.post_feedforward_layernorm,
        ]  # fmt: skip

    def forward(
        self,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, ...],
        metadata: AttentionMetadata,
        kv_store: KVStore,
        layer: int,
        midway: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """Update the residual stream `h` `[T, hidden]` in place and return it; `midway`
        runs between the attention and the MLP."""
        x = rms_norm(h, self.input_layernorm, self.eps)
        attn = self.o(self._attention(x, rope, metadata, kv_store, layer))
        h += rms_norm(attn, self.post_attention_layernorm, self.eps)
        if midway is not None:
            midway()
        x = rms_norm(h, self.pre_feedforward_layernorm, self.eps)
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        mlp = self.down(F.gelu(gate, approximate="tanh").mul_(up))
        h += rms_norm(mlp, self.post_feedforward_layernorm, self.eps)
        return h

    def _attention(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, ...],
        metadata: AttentionMetadata,
        kv_store: KVStore,
        layer: int,
    ) -> torch.Tensor:
        """QK-normed, rotated attention over the layer's window (or all context)."""
        num_tokens, qk_heads = x.shape[0], self.num_heads + self.num_kv_heads
        qkv = self.qkv(x)
        qk = qkv[:, : qk_heads * self.head_dim].view(num_tokens, qk_heads, -1)
        qk = rotate_heads(qk, self.num_heads, rope, (self.q_norm, self.k_norm), self.eps)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, qk_heads * self.head_dim :].view(num_tokens, self.num_kv_heads, -1)
        seen = metadata.for_group(kv_store.groups[layer], self.window)
        k, v = kv_store.write(layer, k, v, seen.slot_mapping)
        out = paged_attention(q.contiguous(), kv_store.layers[layer], seen, self.scale, k, v)
        return out.reshape(num_tokens, -1)


class Gemma3Model(nn.Module):
    """The decoder stack; `forward` returns final-normed hidden states, `compute_logits` the
    logits from the tied embedding."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: str = "cpu"
    ) -> None:
        super().__init__()
        self.config, self.dtype = config, dtype
        param = partial(_param, dtype=dtype, device=device)
        self.embed_tokens = param(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Gemma3Layer(config, config.sliding_window * config.is_window_layer(i), dtype, device)
            for i in range(config.num_layers)
        )
        self.norm = param(config.hidden_size)
        positions = config.max_position_embeddings
        factors = config.rope_freq_factors
        self.rotary = Rotary(config.head_dim, config.rope_theta, positions, factors)
        self.local_rotary = Rotary(config.head_dim, config.rope_local_theta, positions)
        self.head: DenseLinear | PackedLinear = DenseLinear(self.embed_tokens)
        self.embedding: PackedWeight | None = None  # the packed embedding, once quantized
        self.lone = LoneDecode()
        self.fused_weights: FusedWeights | None = None  # built on the first fused decode

    gated_by_gelu = True  # GeGLU

    def rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """cos, sin for the full layers, then for the window layers (their own base)."""
        full, local = self.rotary, self.local_rotary
        return (*full(positions, torch.float32), *local(positions, torch.float32))

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        kv_store: KVStore,
        fused: bool = True,
        between_layers: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """Hidden states `[T, hidden]` of the batch's new tokens, after the final norm. One
        sequence adding a few tokens runs its layers fused (`fused_decode.py`) where it can,
        unless not `fused`. Eager layers call `between_layers` between
        them and halfway through each."""
        h = self._embed(input_ids)
        use_fused = fused and fused_applies(self, kv_store)
        if use_fused and self.lone.prepare(metadata, kv_store, self.dtype, MAX_FUSED_ROWS):
            h = fused_decode(self, h, positions, metadata, kv_store)
            return rms_norm(h, self.norm, self.config.rms_norm_eps)
        full = self.rotary(positions, self.dtype)
        local = self.local_rotary(positions, self.dtype)
        for i, layer in enumerate(self.layers):
            if i and between_layers is not None:
                between_layers()
            h = layer(h, local if layer.window else full, metadata, kv_store, i, between_layers)
        return rms_norm(h, self.norm, self.config.rms_norm_eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits `[N, vocab]` for the rows of `hidden` that need them."""
        return self.head(hidden)

    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy the HF-named tensors in; ValueError lists every mismatch first."""
        copy_weights(self.weight_targets(), state_dict)

    def load_quantized(
        self, state_dict: Mapping[str, torch.Tensor], blocks: Mapping[str, PackedWeight]
    ) -> list[str]:
        """Pack first, then copy in only what stays dense: a packed tensor is never
        dequantized (nor its fp32 parameter touched), so loading takes no fp32 copy of it."""
        targets = self.weight_targets()
        check_weights(targets, state_dict)  # all of them, before quantize empties the packed
        done = self.quantize(blocks)
        dense = {name: target for name, target in targets.items() if name not in done}
        copy_weights(dense, state_dict, checked=True)
        return done

    def quantize(self, blocks: Mapping[str, PackedWeight]) -> list[str]:
        """After `load_weights` (or within `load_quantized`): every projection on its
        file's blocks, and the tied embedding packed too (looked up row by row, and the
        head's matrix): the dense copies are dropped."""
        done = []
        for i, layer in enumerate(self.layers):
            done += quantize_projections(layer, f"model.layers.{i}.", blocks)
        embedding = blocks.get("model.embed_tokens.weight")
        if isinstance(embedding, PackedWeight):
            self.embedding, self.head = embedding, PackedLinear(embedding)
            self.embed_tokens.data = torch.empty(0, dtype=self.dtype)
            done.append("model.embed_tokens.weight")
        return done

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The scaled embeddings of `input_ids`, from the packed matrix once quantized."""
        if self.embedding is not None:
            rows = self.embedding.dequantize_rows(input_ids).to(self.dtype)
        else:
            rows = F.embedding(input_ids, self.embed_tokens)
        return rows * self.config.embedding_scale

    def weight_targets(self) -> dict[str, torch.Tensor]:
        """HF tensor name -> the (view of the) parameter it fills."""
        targets = {"model.embed_tokens.weight": self.embed_tokens, "model.norm.weight": self.norm}
        for i, layer in enumerate(self.layers):
            targets.update(_layer_targets(f"model.layers.{i}.", layer))
        return targets


def _layer_targets(prefix: str, layer: Gemma3Layer) -> dict[str, torch.Tensor]:
    """One layer's HF names: the projections and QK-norms, then the four norms."""
    targets = projection_targets(prefix, layer)
    return targets | {f"{prefix}{name}.weight": getattr(layer, name) for name in _NORMS}


def _gemma3_fields(fields: GgufFields) -> dict[str, object]:
    """Window, RoPE bases, embedding scale; a linear RoPE scaling applies to full layers."""
    window = fields.number("attention.sliding_window")
    hidden, head_dim = fields.number("embedding_length"), fields.number("attention.key_length")
    extra: dict[str, object] = {
        "qk_norm": True,
        "sliding_window": window,
        "window_layers": window_layers(fields),
        "rope_local_theta": LOCAL_ROPE_THETA,
        "embedding_scale": float(hidden) ** 0.5,
    }
    scaling = fields.get("rope.scaling.type", "none")
    if scaling == "linear":
        factor = float(fields.number("rope.scaling.factor", float))
        extra["rope_freq_factors"] = (factor,) * (head_dim // 2)
    elif scaling != "none":
        raise ModelFileError(f"{fields.path}: RoPE scaling {scaling!r} is not supported")
    return extra


def window_layers(fields: GgufFields) -> tuple[bool, ...]:
    """Which layers are window layers: the file's pattern (a period N: every Nth layer is
    full; or one flag per layer), else Gemma 3's period of 6."""
    layers = fields.number("block_count")
    pattern = fields.get("attention.sliding_window_pattern", SLIDING_WINDOW_PATTERN)
    if isinstance(pattern, list) and len(pattern) == layers:
        return tuple(bool(flag) for flag in pattern)
    if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 1:
        return tuple(i % pattern < pattern - 1 for i in range(layers))
    raise ModelFileError(
        f"{fields.path}: attention.sliding_window_pattern must be a period >= 1 or "
        f"{layers} flags, got {str(pattern)[:80]}"
    )


_GEMMA3_NAMES = {
    **BASE_LAYER_NAMES,
    **QK_NORM_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
GEMMA3 = Family("gemma3", Gemma3Model, _GEMMA3_NAMES, _gemma3_fields)
