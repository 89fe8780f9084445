"""The Llama family (Llama 2/3, SmolLM, Mistral, Qwen 2.5, Qwen 3): GQA, RoPE, RMSNorm, SwiGLU.

Qwen 2 adds a bias to q/k/v; Qwen 3 normalises each query and key head (QK-norm) before
RoPE; Llama 3 divides RoPE's frequencies by the file's `rope_freqs`. Attention reads paged
KV blocks. A Llama without a projection bias (Qwen 3's QK-norms included) can run fused
(`fused_decode.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from prefixcache.engine import kernels
from prefixcache.engine.attention import AttentionMetadata, lone_attention, paged_attention
from prefixcache.engine.config import ModelConfig
from prefixcache.engine.fused_decode import (
    MAX_FUSED_ROWS,
    FusedWeights,
    fused_applies,
    fused_decode,
    fused_supported,
)
from prefixcache.engine.int4_head import Int4Head
from prefixcache.engine.kv_store import KVStore
from prefixcache.engine.lone_decode import LoneDecode
from prefixcache.engine.model_files import ModelFileError
from prefixcache.engine.models.family import BASE_LAYER_NAMES, Family, GgufFields
from prefixcache.engine.packed_state import tensor_shapes
from prefixcache.engine.quant import (
    Int4Linear,
    Q4Blocks,
    as_q4_blocks,
    as_q8_blocks,
    can_pack,
)
from prefixcache.engine.weight_types import PackedWeight
from prefixcache.engine.weight_types.linear import ConcatLinear, PackedLinear, packed_linear

# Checkpoint tensors that carry no weights (old HF exports saved the RoPE frequencies).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

log = logging.getLogger(__name__)
_SAID_EAGER: set[str] = set()  # architectures whose eager-only path was logged


def _param(*shape: int, dtype: torch.dtype, device: str = "cpu") -> nn.Parameter:
    """An uninitialised, frozen weight."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class DenseLinear:
    """`y = x W^T` on a dense weight (the layer's parameter)."""

    __slots__ = ("weight",)

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


Linear = DenseLinear | Int4Linear | PackedLinear | ConcatLinear
# Each layer's projections: attribute -> (its parameter, the HF tensors fused into it).
_PROJECTIONS = {
    "qkv": ("qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    "o": ("o_proj", ("self_attn.o_proj",)),
    "gate_up": ("gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
    "down": ("down_proj", ("mlp.down_proj",)),
}


Blocks = Q4Blocks | PackedWeight  # a GGUF weight's own blocks (Q4Blocks: Q4_0/Q4_1 decoded)


def _int4(blocks: Blocks | None) -> Q4Blocks | None:
    """The blocks as torch's int4 kernel takes them, if they are Q4_0/Q4_1."""
    return as_q4_blocks(blocks) if isinstance(blocks, PackedWeight) else blocks


def quantize_projections(layer: nn.Module, prefix: str, blocks: Mapping[str, Blocks]) -> list[str]:
    """Run each of `layer`'s projections (`_PROJECTIONS`) on its GGUF blocks where every
    part has them: on `PackedWeight`'s kernels where the native decoders are vectorized
    (exact, and faster than torch's int4 kernel there: 0.083 against 0.117 ms for one row of
    a 2048 x 640 Q4_0 matrix on AVX2), else all Q4_0/Q4_1 on torch's int4 kernel and other
    types on `PackedWeight`'s. The dense parameter of a projection done is dropped (emptied);
    returns the HF names done.
    """
    done = []
    simd = kernels.simd_decoders()
    for attr, (param_name, parts) in _PROJECTIONS.items():
        names = [f"{prefix}{part}.weight" for part in parts]
        found = [blocks.get(name) for name in names]
        packed = all(isinstance(b, PackedWeight) for b in found)
        int4 = [] if packed and simd else [_int4(b) for b in found]
        fused = Q4Blocks.cat(int4) if int4 and all(int4) else None  # type: ignore[arg-type]
        if fused is not None and can_pack(fused.shape):
            setattr(layer, attr, Int4Linear(fused))
        elif packed:
            setattr(layer, attr, packed_linear(found))  # type: ignore[arg-type]
        else:
            continue
        getattr(layer, param_name).data = torch.empty(0, dtype=layer.input_layernorm.dtype)
        done += names
    return done


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Hugging Face computes it: normalise in fp32, scale in the model dtype. In
    fp32, one native call where the kernels load (torch's takes ~8 ops: 15-35 us a call)."""
    if x.dtype == torch.float32:
        if kernels.available():
            return torch.ops.prefixcache.rms_norm(x, weight, eps)
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype)


class Rotary:
    """RoPE tables per position (half-rotation convention), grown on demand.

    `cos` is `[cos, cos]` and `sin` is `[-sin, sin]` over the head dim, so a rotation is one
    multiply-add with the half-swapped input (`apply_rope`). `freq_factors` (Llama 3's
    `rope_freqs`) divide the frequencies, one per pair of dims.
    """

    def __init__(
        self,
        head_dim: int,
        theta: float,
        max_positions: int,
        freq_factors: tuple[float, ...] = (),
    ) -> None:
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        self.inv_freq = 1.0 / (theta**exponents)
        if freq_factors:
            self.inv_freq = self.inv_freq / torch.tensor(freq_factors, dtype=torch.float32)
        self._build(max(max_positions, 1))

    def _build(self, num_positions: int) -> None:
        freqs = torch.arange(num_positions, dtype=torch.float32)[:, None] * self.inv_freq
        cos, sin = freqs.cos(), freqs.sin()
        self.cos, self.sin = torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos, sin for each position, shaped `[T, 1, head_dim]` to broadcast over heads."""
        needed = int(positions.max()) + 1 if positions.numel() else 0
        if needed > self.cos.shape[0]:
            self._build(1 << (needed - 1).bit_length())
        return self.cos[positions, None].to(dtype), self.sin[positions, None].to(dtype)


def rotate_heads(
    qk: torch.Tensor,
    num_heads: int,
    rope: tuple[torch.Tensor, ...],
    norms: tuple[torch.Tensor, torch.Tensor] | None = None,
    eps: float = 0.0,
) -> torch.Tensor:
    """Query then key heads `[T, heads + kv_heads, head_dim]`, each RMS-normalised by its
    weight first when `norms` (q, k) are given (QK-norm), rotated by `rope`. In fp32, one
    native call where the kernels load (torch takes ~10 ops)."""
    cos, sin = rope
    if qk.dtype == torch.float32 and kernels.available():
        q_norm, k_norm = norms if norms is not None else (None, None)
        return torch.ops.prefixcache.rope_heads(qk, cos, sin, num_heads, q_norm, k_norm, eps)
    if norms is not None:
        q, k = qk[:, :num_heads], qk[:, num_heads:]
        qk = torch.cat((rms_norm(q, norms[0], eps), rms_norm(k, norms[1], eps)), 1)
    return apply_rope(qk, cos, sin)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `[T, heads, head_dim]` by position; equals HF's `x * cos + rotate_half(x) * sin`.

    Rolling by half the head dim gives `[x2, x1]`; with `sin` = `[-sin, sin]` that is
    `rotate_half(x) * sin`.
    """
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin)


class DecoderLayer(nn.Module):
    """Pre-norm attention and SwiGLU MLP, with q/k/v and gate/up fused into one matmul each.

    With `attention_bias` the q/k/v projection adds `qkv_bias`; with `qk_norm` each query
    and key head is RMS-normalised (`q_norm`, `k_norm`) before RoPE.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: str = "cpu") -> None:
        super().__init__()
        c = config
        param = partial(_param, dtype=dtype, device=device)
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.eps = c.rms_norm_eps
        self.scale = c.head_dim**-0.5
        self.window = 0  # full attention
        qkv_rows = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        self.qkv_proj = param(qkv_rows, c.hidden_size)
        self.o_proj = param(c.hidden_size, c.num_heads * c.head_dim)
        self.gate_up_proj = param(2 * c.intermediate_size, c.hidden_size)
        self.down_proj = param(c.hidden_size, c.intermediate_size)
        self.input_layernorm = param(c.hidden_size)
        self.post_attention_layernorm = param(c.hidden_size)
        self.qkv_bias = param(qkv_rows) if c.attention_bias else None
        self.q_norm = param(c.head_dim) if c.qk_norm else None
        self.k_norm = param(c.head_dim) if c.qk_norm else None
        self.qkv: Linear = DenseLinear(self.qkv_proj)
        self.o: Linear = DenseLinear(self.o_proj)
        self.gate_up: Linear = DenseLinear(self.gate_up_proj)
        self.down: Linear = DenseLinear(self.down_proj)

    def quantize(self, prefix: str, blocks: Mapping[str, Blocks]) -> list[str]:
        """Run each projection on its file's blocks; the HF names done (`quantize_projections`)."""
        return quantize_projections(self, prefix, blocks)

    def fused_norms(self) -> list[torch.Tensor]:
        """The norms in the fused kernel's order: input, pre-MLP, then the QK-norms if any."""
        qk = [self.q_norm, self.k_norm] if self.q_norm is not None else []
        return [self.input_layernorm, self.post_attention_layernorm, *qk]  # type: ignore[list-item]

    def forward(
        self,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, ...],
        metadata: AttentionMetadata,
        kv_store: KVStore,
        layer: int,
        lone: LoneDecode | None = None,
        midway: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """Update the residual stream `h` `[T, hidden]` in place and return it; `midway`
        runs between the attention and the MLP."""
        x = rms_norm(h, self.input_layernorm, self.eps)
        h += self.o(self._attention(x, rope, metadata, kv_store, layer, lone))
        if midway is not None:
            midway()
        x = rms_norm(h, self.post_attention_layernorm, self.eps)
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        h += self.down(F.silu(gate).mul_(up))
        return h

    def _attention(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, ...],
        metadata: AttentionMetadata,
        kv_store: KVStore,
        layer: int,
        lone: LoneDecode | None,
    ) -> torch.Tensor:
        """Project, rotate, store the whole batch's K/V, then attend: `[T, heads * head_dim]`."""
        num_tokens, qk_heads = x.shape[0], self.num_heads + self.num_kv_heads
        qkv = self.qkv(x)
        if self.qkv_bias is not None:
            qkv += self.qkv_bias
        qk = qkv[:, : qk_heads * self.head_dim].view(num_tokens, qk_heads, -1)
        norms = (self.q_norm, self.k_norm) if self.q_norm is not None else None
        qk = rotate_heads(qk, self.num_heads, rope, norms, self.eps)  # type: ignore[arg-type]
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, qk_heads * self.head_dim :].view(num_tokens, self.num_kv_heads, -1)
        k, v = kv_store.write(layer, k, v, metadata.slot_mapping)
        if lone is not None:
            keys, values = lone.extend(layer, k, v, kv_store.layers[layer])
            return lone_attention(q, keys, values, self.scale).reshape(num_tokens, -1)
        out = paged_attention(q, kv_store.layers[layer], metadata, self.scale, k, v)
        return out.reshape(num_tokens, -1)


class LlamaModel(nn.Module):
    """Decoder stack; `forward` returns final-normed hidden states, `compute_logits` the rest."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: str = "cpu"
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        param = partial(_param, dtype=dtype, device=device)
        self.embed_tokens = param(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, dtype, device) for _ in range(config.num_layers)
        )
        self.norm = param(config.hidden_size)
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = param(config.vocab_size, config.hidden_size)
        self.rotary = Rotary(
            config.head_dim,
            config.rope_theta,
            config.max_position_embeddings,
            config.rope_freq_factors,
        )
        self.head: DenseLinear | Int4Head | PackedLinear = DenseLinear(self._head_weight())
        self.embedding: PackedWeight | None = None  # the packed embedding, once quantized
        self.lone = LoneDecode()
        self.fused_weights: FusedWeights | None = None  # built on the first fused decode
        if not fused_supported(config) and config.architecture not in _SAID_EAGER:
            _SAID_EAGER.add(config.architecture)
            log.info("%s: no fused kernel for its layers yet; the eager path runs", config.name)

    gated_by_gelu = False  # the MLP's gate: SiLU

    def rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """cos, sin for the full layers, then for the window layers (the same: none here)."""
        cos, sin = self.rotary(positions, torch.float32)
        return cos, sin, cos, sin

    def _head_weight(self) -> torch.Tensor:
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of `input_ids`: rows of the packed matrix once quantized (the same
        values as the dense one's: gguf-py's dequantization, bit for bit)."""
        if self.embedding is not None:
            return self.embedding.dequantize_rows(input_ids).to(self.dtype)
        return F.embedding(input_ids, self.embed_tokens)

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
        """Hidden states `[T, hidden]` of the batch's new tokens, after the final norm.

        One sequence adding a few tokens runs its layers fused (`fused_decode.py`) where it
        can, unless not `fused`. Eager layers call `between_layers` between
        them and halfway through each.
        """
        h = self._embed(input_ids)
        use_fused = fused and fused_applies(self, kv_store)
        max_rows = MAX_FUSED_ROWS if use_fused else 1
        is_lone = self.lone.prepare(metadata, kv_store, self.dtype, max_rows)
        if use_fused and is_lone:
            h = fused_decode(self, h, positions, metadata, kv_store)
            return rms_norm(h, self.norm, self.config.rms_norm_eps)
        rope = self.rotary(positions, self.dtype)
        lone = self.lone if is_lone else None
        for i, layer in enumerate(self.layers):
            if i and between_layers is not None:
                between_layers()
            h = layer(h, rope, metadata, kv_store, i, lone, between_layers)
        return rms_norm(h, self.norm, self.config.rms_norm_eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits `[N, vocab]` for the rows of `hidden` that need them."""
        return self.head(hidden)

    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy Hugging Face Llama-named tensors in; ValueError lists every mismatch first."""
        copy_weights(self.weight_targets(), state_dict)

    def load_quantized(
        self, state_dict: Mapping[str, torch.Tensor], blocks: Mapping[str, Blocks]
    ) -> list[str]:
        """`load_weights`, then `quantize` (its int4 head refines on the dense matrix)."""
        self.load_weights(state_dict)
        return self.quantize(blocks)

    def quantize(self, blocks: Mapping[str, Blocks]) -> list[str]:
        """After `load_weights`: run what `blocks` (HF names) cover on their file's blocks.

        Layer projections (`quantize_projections`), and the output matrix: on its
        `PackedWeight` (exact, and read once per token) where the native decoders are
        vectorized; else a Q4 or Q8_0 one of an fp32 model as `Int4Head` (dense kept for its
        exact refinement; measured on AVX2, SmolLM2's head took 4.2 ms there, 1.5 ms packed).
        Norms stay dense; a packed embedding is then looked up by rows (unless the int4 head
        refines on it, or a dense head reads it). Returns the names.
        """
        done = []
        for i, layer in enumerate(self.layers):
            done += layer.quantize(f"model.layers.{i}.", blocks)
        name = "model.embed_tokens.weight" if self.lm_head is None else "lm_head.weight"
        head = blocks.get(name)
        simd = kernels.simd_decoders()
        planes = None
        if not (isinstance(head, PackedWeight) and simd):
            planes = _int4(head) or (as_q8_blocks(head) if isinstance(head, PackedWeight) else None)
        if planes is not None and self.dtype == torch.float32 and can_pack(planes.codes.shape):
            self.head = Int4Head(planes, self._head_weight().detach())
            done.append(name)
        elif isinstance(head, PackedWeight):
            self.head = PackedLinear(head)
            if self.lm_head is not None:
                self.lm_head.data = torch.empty(0, dtype=self.dtype)
            done.append(name)
        embedding = blocks.get("model.embed_tokens.weight")
        head_reads_it = self.lm_head is None and isinstance(self.head, Int4Head | DenseLinear)
        if isinstance(embedding, PackedWeight) and simd and not head_reads_it:
            self.embedding = embedding  # looked up by rows; the dense copy is dropped
            self.embed_tokens.data = torch.empty(0, dtype=self.dtype)
            if self.lm_head is not None:  # tied, it is the head's name, done already
                done.append("model.embed_tokens.weight")
        return done

    def weight_targets(self) -> dict[str, torch.Tensor]:
        """HF tensor name -> the (view of the) parameter it fills: the model's tensor mapping."""
        targets = {"model.embed_tokens.weight": self.embed_tokens, "model.norm.weight": self.norm}
        if self.lm_head is not None:
            targets["lm_head.weight"] = self.lm_head
        for i, layer in enumerate(self.layers):
            targets.update(_layer_targets(f"model.layers.{i}.", layer))
        return targets


def _layer_targets(prefix: str, layer: DecoderLayer) -> dict[str, torch.Tensor]:
    """One layer's HF names: the projections, the norms, the q/k/v biases if any."""
    targets = projection_targets(prefix, layer)
    targets[prefix + "input_layernorm.weight"] = layer.input_layernorm
    targets[prefix + "post_attention_layernorm.weight"] = layer.post_attention_layernorm
    if layer.qkv_bias is not None:
        q_bias, k_bias, v_bias = layer.qkv_bias.split(_qkv_rows(layer))
        attn = prefix + "self_attn."
        targets |= {attn + "q_proj.bias": q_bias, attn + "k_proj.bias": k_bias}
        targets[attn + "v_proj.bias"] = v_bias
    return targets


def projection_targets(prefix: str, layer: nn.Module) -> dict[str, torch.Tensor]:
    """A layer's projections by HF name, q/k/v and gate/up as slices of the fused weights,
    and its QK-norms if it has them (every family here fuses them the same way)."""
    q, k, v = layer.qkv_proj.split(_qkv_rows(layer))
    gate, up = layer.gate_up_proj.chunk(2)
    attn, mlp = prefix + "self_attn.", prefix + "mlp."
    targets = {
        attn + "q_proj.weight": q,
        attn + "k_proj.weight": k,
        attn + "v_proj.weight": v,
        attn + "o_proj.weight": layer.o_proj,
        mlp + "gate_proj.weight": gate,
        mlp + "up_proj.weight": up,
        mlp + "down_proj.weight": layer.down_proj,
    }
    if layer.q_norm is not None and layer.k_norm is not None:
        targets |= {attn + "q_norm.weight": layer.q_norm, attn + "k_norm.weight": layer.k_norm}
    return targets


def _qkv_rows(layer: nn.Module) -> list[int]:
    """Rows of q, k and v in the fused projection."""
    kv_rows = layer.num_kv_heads * layer.head_dim
    return [layer.num_heads * layer.head_dim, kv_rows, kv_rows]


def check_weights(
    targets: Mapping[str, torch.Tensor], state_dict: Mapping[str, torch.Tensor]
) -> None:
    """ValueError listing every tensor of ``state_dict`` missing, unexpected or mis-shaped for
    ``targets``."""
    expected = {n: tuple(t.shape) for n, t in targets.items()}
    problems = tensor_problems(expected, tensor_shapes(state_dict))
    if problems:
        raise ValueError("cannot load weights: " + "; ".join(problems))


def copy_weights(
    targets: Mapping[str, torch.Tensor],
    state_dict: Mapping[str, torch.Tensor],
    checked: bool = False,
) -> None:
    """Copy each HF-named tensor into its target, after `check_weights` unless ``checked``."""
    if not checked:
        check_weights(targets, state_dict)
    with torch.no_grad():
        for name, target in targets.items():
            target.copy_(torch.as_tensor(state_dict[name]))


def tensor_problems(
    expected: Mapping[str, tuple[int, ...]], shapes: Mapping[str, tuple[int, ...]]
) -> list[str]:
    """Missing, unexpected and mis-shaped tensors (``shapes``: a checkpoint's), one message
    per kind. A tied model ignores a checkpoint's ``lm_head.weight``; old exports' RoPE
    tables too.
    """
    allowed = set(expected) | {"lm_head.weight"}
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(n for n in shapes if n not in allowed and not n.endswith(_IGNORED_SUFFIXES))
    misshaped = [
        f"{n} has shape {shapes[n]}, expected {shape}"
        for n, shape in expected.items()
        if n in shapes and shapes[n] != shape
    ]
    problems = []
    for kind, names in (
        ("missing tensors", missing),
        ("unexpected tensors", unexpected),
        ("mis-shaped tensors", misshaped),
    ):
        if names:
            problems.append(f"{kind} {short_list(names)}")
    return problems


def short_list(names: list[str], limit: int = 8) -> str:
    """At most ``limit`` names, then how many more."""
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"


def _llama_fields(fields: GgufFields) -> dict[str, object]:
    """Llama's extras: Llama 3's RoPE divisors (`rope_freqs.weight`); other scalings refused."""
    scaling = fields.get("rope.scaling.type", "none")
    if scaling != "none":
        raise ModelFileError(f"{fields.path}: RoPE scaling {scaling!r} is not supported")
    factors = fields.vector("rope_freqs.weight")
    return {} if factors is None else {"rope_freq_factors": tuple(map(float, factors))}


LLAMA_LAYER_NAMES = {**BASE_LAYER_NAMES, "ffn_norm.weight": "post_attention_layernorm.weight"}
LLAMA = Family(
    "llama",
    LlamaModel,
    LLAMA_LAYER_NAMES,
    _llama_fields,
    permuted_qk=True,
    consumed=frozenset({"rope_freqs.weight"}),
)
