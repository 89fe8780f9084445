"""Model files -> config, float32 weights under Hugging Face Llama names, and tokenizer.

Two sources: a GGUF file (dequantized with the `gguf` package, llama.cpp's Q/K row permutation
undone; Q4_0/Q4_1 weights and a Q8_0 output matrix are also kept as their blocks, for
`engine/quant.py`) or a Hugging Face folder (`config.json`, `*.safetensors`, `tokenizer.json`).
Finding and opening the files, and the tokenizer alone, are in `engine/model_files.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf.quants import dequantize
from safetensors import SafetensorError
from safetensors.torch import load_file

from prefixcache.engine.config import ModelConfig
from prefixcache.engine.model import LlamaModel, hf_tensor_shapes, short_list, tensor_problems
from prefixcache.engine.model_files import (
    ModelFileError,
    gguf_metadata,
    gguf_tokenizer,
    model_source,
    open_gguf,
    read_json,
)
from prefixcache.engine.quant import Q4Blocks, Q8Blocks, is_q4, is_q8, q4_blocks, q8_blocks
from prefixcache.engine.tokenizer import Tokenizer

SUPPORTED_ARCHITECTURES = frozenset({"llama"})

# GGUF tensor name -> HF name, per layer ("blk.{i}." / "model.layers.{i}.").
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


@dataclass(slots=True)
class LoadedModel:
    """Everything the engine needs from a model source."""

    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    source: Path
    quantized: dict[str, Q4Blocks | Q8Blocks] = field(default_factory=dict)  # HF name -> blocks
    # Built already (`engine/weight_cache.py`): the fp32 model on int4 kernels, its int4 names.
    model: LlamaModel | None = None
    int4_weights: list[str] = field(default_factory=list)


def load_model(path: str | Path | None = None) -> LoadedModel:
    """Load a GGUF file or a Hugging Face folder; None means the default model."""
    source = model_source(path)
    if source.is_dir():
        return _load_hf_folder(source)
    return _load_gguf(source)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every state-dict name a checkpoint for `config` must have, with its HF shape."""
    return hf_tensor_shapes(config)


def check_state_dict(state: dict[str, torch.Tensor], config: ModelConfig, source: Path) -> None:
    """Raise ModelFileError naming every missing, unexpected or misshapen tensor."""
    problems = tensor_problems(expected_shapes(config), state)
    if problems:
        raise ModelFileError(f"{source}: " + "; ".join(problems))


# ---------------------------------------------------------------- GGUF


def _load_gguf(path: Path) -> LoadedModel:
    reader = open_gguf(path)
    meta = gguf_metadata(reader, path)
    tokenizer = gguf_tokenizer(meta, path)
    tensors = {t.name: t for t in reader.tensors}
    config = _gguf_config(meta, tensors, tokenizer, path)
    names = _gguf_names(tensors, config, path)
    state = {hf: _gguf_tensor(tensors[g], config, path) for g, hf in names.items()}
    check_state_dict(state, config, path)
    return LoadedModel(config, state, tokenizer, path, _gguf_blocks(tensors, names, config))


def _gguf_blocks(
    tensors: dict[str, Any], names: dict[str, str], config: ModelConfig
) -> dict[str, Q4Blocks | Q8Blocks]:
    """The 2-D Q4_0/Q4_1 tensors as `Q4Blocks`; a Q8_0 output matrix as `Q8Blocks`."""
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    blocks: dict[str, Q4Blocks | Q8Blocks] = {}
    for g, hf in names.items():
        tensor = tensors[g]
        if len(tensor.shape) == 2 and is_q4(tensor.tensor_type):
            blocks[hf] = _gguf_q4(tensor, config)
        elif g == head and is_q8(tensor.tensor_type):
            blocks[hf] = q8_blocks(tensor.data, (int(tensor.shape[1]), int(tensor.shape[0])))
    return blocks


def _gguf_config(
    meta: dict[str, Any], tensors: dict[str, Any], tokenizer: Tokenizer, path: Path
) -> ModelConfig:
    """ModelConfig from `{arch}.*` metadata; tied embeddings when there is no output.weight."""
    arch = _check_gguf_support(meta, path)
    heads = _gguf_number(meta, f"{arch}.attention.head_count", path)
    hidden = _gguf_number(meta, f"{arch}.embedding_length", path)
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    rotary = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise ModelFileError(f"{path}: partial RoPE ({rotary} of {head_dim} dims) not supported")
    return _make_config(
        path,
        vocab_size=len(meta["tokenizer.ggml.tokens"]),
        hidden_size=hidden,
        intermediate_size=_gguf_number(meta, f"{arch}.feed_forward_length", path),
        num_layers=_gguf_number(meta, f"{arch}.block_count", path),
        num_heads=heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=_gguf_number(meta, f"{arch}.attention.layer_norm_rms_epsilon", path, float),
        max_position_embeddings=_gguf_number(meta, f"{arch}.context_length", path),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
        name=str(meta.get("general.name") or path.stem),
        revision=_gguf_file_type(meta),
    )


def _check_gguf_support(meta: dict[str, Any], path: Path) -> str:
    """The architecture name, if it is one we run; else ModelFileError."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        raise ModelFileError(f"{path}: architecture {arch!r} is not supported (only {supported})")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ModelFileError(f"{path}: RoPE scaling {scaling!r} is not supported")
    return arch


def _gguf_number(meta: dict[str, Any], key: str, path: Path, kind: type = int) -> Any:
    """A required positive scalar metadata value."""
    value = meta.get(key)
    if value is None or isinstance(value, list | str) or not value > 0:
        raise ModelFileError(f"{path}: metadata {key} is missing or not a positive number")
    return kind(value)


def _gguf_file_type(meta: dict[str, Any]) -> str:
    """The quantization label (e.g. MOSTLY_Q4_1): quantized weights give different KV values."""
    try:
        return gguf.LlamaFileType(int(meta["general.file_type"])).name
    except (KeyError, ValueError, TypeError):
        return ""


def _gguf_names(tensors: dict[str, Any], config: ModelConfig, path: Path) -> dict[str, str]:
    """GGUF tensor name -> HF name; ModelFileError naming missing and unexpected tensors."""
    names = {"token_embd.weight": "model.embed_tokens.weight"}
    names["output_norm.weight"] = "model.norm.weight"
    if not config.tie_word_embeddings:
        names["output.weight"] = "lm_head.weight"
    for i in range(config.num_layers):
        names.update({f"blk.{i}.{g}": f"model.layers.{i}.{h}" for g, h in _LAYER_NAMES.items()})
    problems = []
    if missing := sorted(set(names) - set(tensors), key=_natural):
        problems.append(f"missing tensors {short_list(missing)}")
    if extra := sorted(set(tensors) - set(names), key=_natural):
        problems.append(f"unexpected tensors {short_list(extra)}")
    if problems:
        raise ModelFileError(f"{path}: " + "; ".join(problems))
    return names


def _gguf_tensor(tensor: Any, config: ModelConfig, path: Path) -> torch.Tensor:
    """One tensor as float32 in HF layout ([out_features, in_features])."""
    shape = tuple(int(d) for d in reversed(tensor.shape))  # ggml lists the fastest dim first
    try:
        values = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
    except (NotImplementedError, ValueError) as exc:
        kind = getattr(tensor.tensor_type, "name", tensor.tensor_type)
        raise ModelFileError(f"{path}: cannot dequantize {tensor.name} ({kind}): {exc}") from exc
    if ".attn_q." in tensor.name:
        values = unpermute_qk(values, config.num_heads)
    elif ".attn_k." in tensor.name:
        values = unpermute_qk(values, config.num_kv_heads)
    # Dequantized arrays are fresh; F32 ones are read-only views of the file and get copied.
    return torch.from_numpy(np.require(values, np.float32, ["C", "W"]))


def _gguf_q4(tensor: Any, config: ModelConfig) -> Q4Blocks:
    """A Q4_0/Q4_1 tensor's blocks in HF layout, Q/K rows un-permuted like `_gguf_tensor`."""
    shape = (int(tensor.shape[1]), int(tensor.shape[0]))
    blocks = q4_blocks(tensor.data, tensor.tensor_type, shape)
    for marker, heads in ((".attn_q.", config.num_heads), (".attn_k.", config.num_kv_heads)):
        if marker in tensor.name:
            blocks = blocks.rows(unpermute_qk(np.arange(shape[0]), heads))
    return blocks


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's converter, which interleaves each head's two RoPE halves row-wise.

    llama.cpp stores head rows as (dim/2, 2) pairs for its interleaved RoPE; HF's rotate_half
    wants the (2, dim/2) order, so each head's rows are transposed back.
    """
    half = weight.shape[0] // num_heads // 2
    grouped = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weight.shape)


# ---------------------------------------------------------------- Hugging Face folder


def _load_hf_folder(folder: Path) -> LoadedModel:
    for required in ("config.json", "tokenizer.json"):
        if not (folder / required).is_file():
            hint = "".join(f"; it holds {p.name}: pass that file" for p in folder.glob("*.gguf"))
            raise ModelFileError(
                f"{folder}: no {required} (not a Hugging Face model folder){hint[:200]}"
            )
    raw = read_json(folder / "config.json")
    eos = _as_ids(raw.get("eos_token_id"))
    generation = folder / "generation_config.json"
    if generation.is_file():
        eos += _as_ids(read_json(generation).get("eos_token_id"))
    try:
        tokenizer = Tokenizer.from_hf_folder(folder, extra_eos_ids=eos)
    except Exception as exc:  # tokenizers raises its own exception types for a bad file
        raise ModelFileError(f"{folder}: cannot load its tokenizer: {exc}") from exc
    config = _hf_config(raw, tokenizer, folder)
    state = _hf_state_dict(folder, config)
    return LoadedModel(config, state, tokenizer, folder)


def _hf_config(raw: dict[str, Any], tokenizer: Tokenizer, folder: Path) -> ModelConfig:
    """ModelConfig from a transformers LlamaConfig dict."""
    path = folder / "config.json"
    _check_hf_support(raw, path)
    rope = raw.get("rope_parameters") or {}
    return _make_config(
        path,
        **_hf_shape(raw, path),
        rope_theta=float(raw.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=_first(_as_ids(raw.get("bos_token_id")), tokenizer.bos_token_id),
        eos_token_ids=tokenizer.eos_token_ids,
        name=str(raw.get("_name_or_path") or folder.name),
        revision=str(raw.get("dtype") or raw.get("torch_dtype") or ""),
    )


def _check_hf_support(raw: dict[str, Any], path: Path) -> None:
    """ModelFileError unless the config describes a plain Llama we can run."""
    if raw.get("model_type") not in SUPPORTED_ARCHITECTURES:
        raise ModelFileError(f"{path}: model_type {raw.get('model_type')!r} is not supported")
    scaling = raw.get("rope_scaling") or {}
    rope_type = (
        scaling.get("rope_type")
        or scaling.get("type")
        or (raw.get("rope_parameters") or {}).get("rope_type")
    )
    if rope_type not in (None, "default"):
        raise ModelFileError(f"{path}: RoPE scaling {rope_type!r} is not supported")
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise ModelFileError(f"{path}: attention/MLP biases are not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelFileError(f"{path}: hidden_act {raw['hidden_act']!r} is not supported (silu)")


def _hf_shape(raw: dict[str, Any], path: Path) -> dict[str, int]:
    """The size fields of a LlamaConfig dict, with transformers' defaults for kv heads/head_dim."""
    try:
        heads, hidden = int(raw["num_attention_heads"]), int(raw["hidden_size"])
        return {
            "vocab_size": int(raw["vocab_size"]),
            "hidden_size": hidden,
            "intermediate_size": int(raw["intermediate_size"]),
            "num_layers": int(raw["num_hidden_layers"]),
            "num_heads": heads,
            "num_kv_heads": int(raw.get("num_key_value_heads") or heads),
            "head_dim": int(raw.get("head_dim") or hidden // heads),
        }
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        raise ModelFileError(f"{path}: missing or bad field {exc}") from exc


def _hf_state_dict(folder: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """All `*.safetensors` shards as float32; a tied lm_head and RoPE buffers are dropped."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelFileError(f"{folder}: no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            shard = load_file(file)
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelFileError(f"{file}: unreadable safetensors ({exc})") from exc
        state.update({k: v.to(torch.float32) for k, v in shard.items()})
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    check_state_dict(state, config, folder)
    return state


# ---------------------------------------------------------------- helpers


def _make_config(path: Path, **fields: Any) -> ModelConfig:
    try:
        return ModelConfig(**fields)
    except (ValueError, ZeroDivisionError) as exc:
        raise ModelFileError(f"{path}: {exc}") from exc


def _as_ids(value: object) -> list[int]:
    """A token id field that may be null, an int or a list of ints."""
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def _first(ids: list[int], default: int | None) -> int | None:
    return ids[0] if ids else default


def _natural(name: str) -> tuple[Any, ...]:
    """Sort key so blk.2 comes before blk.10."""
    return tuple((int(p), "") if p.isdigit() else (-1, p) for p in name.split("."))
