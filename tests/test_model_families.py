"""Every model family from a GGUF alone: tiny random models against transformers.

For each family a tiny transformers model gets random weights; the test writes it as a GGUF
the way llama.cpp's converter does (gguf-py's own tensor-name map, Q/K rows interleaved for
Llama, Gemma's norms stored as `1 + w`, Llama 3's `rope_freqs`), some tensors quantized
(gguf-py's quantizer; K-quant tensors as random valid blocks). transformers then runs the
weights the GGUF holds (dequantized by gguf-py), and our engine runs the GGUF file itself.

Tolerance: logits within 2e-3 absolute. Both sides compute in float32 from the same float32
weights; what differs is summation order (matmuls over up to 256 terms, softmax over up to
80 keys) and RMSNorm's formulation, each ~1e-6 relative, compounded over the layers of
logits of magnitude ~1-10: 1e-4 was observed; 2e-3 leaves room across CPUs' kernels without
hiding a wrong weight, mask or RoPE table (each of those moves logits by > 0.1).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from tokenizers import pre_tokenizers

from prefixcache.engine import kernels
from prefixcache.engine.attention import AttentionMetadata
from prefixcache.engine.kv_store import KVStore
from prefixcache.engine.models import build_model
from prefixcache.engine.weights import load_model

ATOL = 2e-3
VOCAB_TOKENS = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["<s>", "</s>"]
VOCAB = len(VOCAB_TOKENS)  # 258
HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 256, 512, 4, 2, 64, 3
BLOCK = 4

# Which GGUF type each kind of tensor is written in (K-quants need 256-wide rows).
TYPES = {
    "attn_q": Q.Q5_0,
    "attn_k": Q.Q8_0,
    "attn_v": Q.Q4_1,
    "attn_output": Q.Q4_K,
    "ffn_gate": Q.Q4_0,
    "ffn_up": Q.F16,
    "ffn_down": Q.Q6_K,
    "token_embd": Q.Q8_0,
    "output": Q.BF16,
}
_K_QUANTS = {Q.Q4_K: (144, (0, 2)), Q.Q6_K: (210, (208,)), Q.Q5_K: (176, (0, 2))}


@dataclass(frozen=True)
class Case:
    """One family: its GGUF architecture and transformers' config for it."""

    arch: gguf.MODEL_ARCH
    hf_config: transformers.PretrainedConfig
    tied: bool = True


def _llama3() -> transformers.LlamaConfig:
    rope = {
        "rope_type": "llama3",
        "rope_theta": 50000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    return transformers.LlamaConfig(**_shape(), rope_parameters=rope, tie_word_embeddings=False)


def _shape() -> dict[str, object]:
    return {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 256,
        "attn_implementation": "eager",
    }


CASES = {
    "llama3": Case(gguf.MODEL_ARCH.LLAMA, _llama3(), tied=False),
    "qwen2": Case(
        gguf.MODEL_ARCH.QWEN2,
        transformers.Qwen2Config(**_shape(), rope_theta=1e6, tie_word_embeddings=True),
    ),
    "qwen3": Case(
        gguf.MODEL_ARCH.QWEN3,
        transformers.Qwen3Config(**_shape(), rope_theta=1e6, tie_word_embeddings=True),
    ),
    "gemma3": Case(
        gguf.MODEL_ARCH.GEMMA3,
        transformers.Gemma3TextConfig(
            **_shape(),
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            query_pre_attn_scalar=HEAD_DIM,
            tie_word_embeddings=True,
        ),
    ),
}


def _hf_model(case: Case) -> transformers.PreTrainedModel:
    """transformers' model of the family with random weights (norms and biases included)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(case.hf_config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            scale = 0.5 if "norm" in name else 0.08
            param.copy_(torch.randn_like(param) * scale + (1.0 if "norm" in name else 0.0))
            if "norm" in name and case.arch == gguf.MODEL_ARCH.GEMMA3:
                param.sub_(1.0)  # Gemma scales by 1 + w
    return model.eval()


def _write_gguf(case: Case, model: transformers.PreTrainedModel, path: Path) -> None:
    """The model as llama.cpp's converter writes it; the model then gets the file's weights."""
    name_map = gguf.get_tensor_name_map(case.arch, LAYERS)
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[case.arch])
    _metadata(writer, case)
    state = model.state_dict()
    loaded = {}
    for hf_name, tensor in state.items():
        if hf_name == "lm_head.weight" and case.tied:
            continue
        name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        values = _to_file(case, name, tensor.detach().numpy().astype(np.float32))
        raw, kind = _encode(name, values)
        writer.add_tensor(name, raw, raw_dtype=kind)
        back = dequantize(raw, kind).reshape(values.shape) if kind != Q.F32 else values
        loaded[hf_name] = torch.from_numpy(_from_file(case, name, back.astype(np.float32)))
    if case.arch == gguf.MODEL_ARCH.LLAMA:
        writer.add_tensor("rope_freqs.weight", _llama3_rope_freqs(case.hf_config))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model.load_state_dict(loaded, strict=False)
    if case.tied:
        model.tie_weights()


def _metadata(writer: gguf.GGUFWriter, case: Case) -> None:
    config = case.hf_config
    writer.add_name("tiny")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if case.arch == gguf.MODEL_ARCH.GEMMA3:
        writer.add_rope_freq_base(1e6)
        writer.add_sliding_window(config.sliding_window)
        flags = [t == "sliding_attention" for t in config.layer_types]
        writer.add_sliding_window_pattern(flags)
    else:
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(VOCAB_TOKENS)
    writer.add_token_types([1] * (VOCAB - 2) + [3, 3])
    writer.add_token_merges([])
    writer.add_bos_token_id(VOCAB - 2)
    writer.add_eos_token_id(VOCAB - 1)


def _to_file(case: Case, name: str, values: np.ndarray) -> np.ndarray:
    """llama.cpp's conventions: Llama's Q/K rows interleaved, Gemma's norms as `1 + w`."""
    if case.arch == gguf.MODEL_ARCH.LLAMA and name.endswith(("attn_q.weight", "attn_k.weight")):
        heads = HEADS if "attn_q" in name else KV_HEADS
        rows = values.reshape(heads, 2, values.shape[0] // heads // 2, *values.shape[1:])
        return np.ascontiguousarray(rows.swapaxes(1, 2).reshape(values.shape))
    if case.arch == gguf.MODEL_ARCH.GEMMA3 and name.endswith("norm.weight"):
        return values + 1
    return values


def _from_file(case: Case, name: str, values: np.ndarray) -> np.ndarray:
    """The inverse of `_to_file`: what transformers' model must hold."""
    if case.arch == gguf.MODEL_ARCH.LLAMA and name.endswith(("attn_q.weight", "attn_k.weight")):
        heads = HEADS if "attn_q" in name else KV_HEADS
        rows = values.reshape(heads, values.shape[0] // heads // 2, 2, *values.shape[1:])
        return np.ascontiguousarray(rows.swapaxes(1, 2).reshape(values.shape))
    if case.arch == gguf.MODEL_ARCH.GEMMA3 and name.endswith("norm.weight"):
        return values - 1
    return values


def _encode(name: str, values: np.ndarray) -> tuple[np.ndarray, Q]:
    """A 2-D weight in its kind's type (K-quants: random valid blocks); vectors in F32."""
    kind = TYPES.get(name.split(".")[-2], Q.F32) if values.ndim == 2 else Q.F32
    if kind == Q.F32:
        return values, kind
    if kind in _K_QUANTS:
        return _random_blocks(kind, values.shape), kind
    return quantize(values, kind), kind


def _random_blocks(kind: Q, shape: tuple[int, ...]) -> np.ndarray:
    """Random K-quant blocks whose fp16 scales are small, finite numbers."""
    size, scale_offsets = _K_QUANTS[kind]
    rows, cols = shape
    rng = np.random.default_rng(int(kind) * 7 + rows)
    blocks = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    scales = (rng.random((rows, cols // 256, len(scale_offsets))) * 2e-3).astype(np.float16)
    for i, offset in enumerate(scale_offsets):
        blocks[..., offset : offset + 2] = scales[..., i : i + 1].view(np.uint8)
    return blocks.reshape(rows, -1)


def _llama3_rope_freqs(config: transformers.LlamaConfig) -> np.ndarray:
    """llama.cpp's converter's `rope_freqs`: the divisor of each RoPE frequency."""
    rope = config.rope_parameters
    base, factor = rope["rope_theta"], rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    freqs = 1.0 / base ** (np.arange(0, HEAD_DIM, 2, dtype=np.float32) / HEAD_DIM)
    factors = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


@pytest.fixture(scope="module", params=[(n, q) for n in sorted(CASES) for q in (False, True)])
def family_pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """transformers' model, and ours from the GGUF: dense float32, or (`quantized`) running
    every projection on the file's own blocks (int4 kernel for Q4_0/Q4_1, the packed
    kernels for the rest)."""
    name, quantized = request.param
    case = CASES[name]
    reference = _hf_model(case)
    path = tmp_path_factory.mktemp(name) / f"tiny-{name}.gguf"
    _write_gguf(case, reference, path)
    loaded = load_model(path)
    ours = build_model(loaded.config)
    ours.load_weights(loaded.state_dict)
    if quantized:
        done = ours.quantize(loaded.quantized)
        # an untied embedding stays dense only where the GGUF decoders are not vectorized
        untied = not case.tied and not kernels.simd_decoders()
        kept_dense = {"model.embed_tokens.weight"} if untied else set()
        assert set(done) == set(loaded.quantized) - kept_dense
    return name, reference, ours, loaded


def _ours(model: torch.nn.Module, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Our logits for `ids`, computed in prefill chunks of the given sizes over paged KV."""
    config = model.config
    blocks = -(-len(ids) // BLOCK)
    store = KVStore(config.num_layers, blocks + 1, BLOCK, KV_HEADS, HEAD_DIM, torch.float32)
    table = list(range(1, blocks + 1))
    out, done = [], 0
    for size in chunks:
        meta = AttentionMetadata.build([size], [done + size], [table], BLOCK)
        hidden = model(
            torch.tensor(ids[done : done + size]), torch.arange(done, done + size), meta, store
        )
        out.append(model.compute_logits(hidden))
        done += size
    return torch.cat(out)


def test_the_gguf_describes_the_family(family_pair) -> None:
    name, _, _, loaded = family_pair
    config = loaded.config
    assert config.architecture == {"llama3": "llama"}.get(name, name)
    assert (config.num_layers, config.head_dim, config.num_kv_heads) == (LAYERS, HEAD_DIM, 2)
    assert config.tie_word_embeddings == (name != "llama3")
    assert config.attention_bias == (name == "qwen2")
    assert config.qk_norm == (name in ("qwen3", "gemma3"))
    assert bool(config.rope_freq_factors) == (name == "llama3")
    windows = [config.is_window_layer(i) for i in range(LAYERS)]
    assert windows == ([True, False, True] if name == "gemma3" else [False] * LAYERS)


@pytest.mark.parametrize("chunks", [[40], [1] * 12 + [28], [17, 1, 22]])
def test_logits_match_transformers(family_pair, chunks: list[int]) -> None:
    """Whole prompt, token by token, and uneven chunks: past Llama 3's original context and
    Gemma's window (6), so the RoPE scaling and the window masks both matter."""
    _, reference, ours, _ = family_pair
    ids = torch.randint(0, VOCAB - 2, (40,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
    got = _ours(ours, ids.tolist(), chunks)
    assert expected.abs().max() > 0.5  # the logits are not trivially small
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
