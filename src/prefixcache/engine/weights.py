"""Model files -> config, float32 weights under Hugging Face Llama names, and tokenizer.

Two sources: a GGUF file (dequantized with the `gguf` package, llama.cpp's Q/K row permutation
undone; Q4_0/Q4_1 weights and a Q8_0 output matrix are also kept as their blocks, for
`engine/quant.py`) or a Hugging Face folder (`config.json`, `*.safetensors`, `tokenizer.json`).
Finding and opening the files, and the tokenizer alone, are in `engine/model_files.py`.
"""

from __future__ import annotations

from collections.abc import Mapping
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
from prefixcache.engine.model_files import (
    ModelFileError,
    gguf_metadata,
    gguf_tokenizer,
    model_source,
    open_gguf,
    read_json,
)
from prefixcache.engine.models import SUPPORTED_ARCHITECTURES, build_model, family
from prefixcache.engine.models.family import Family, GgufFields
from prefixcache.engine.models.llama import short_list, tensor_problems
from prefixcache.engine.packed_state import PackedStateDict, tensor_shapes
from prefixcache.engine.tokenizer import Tokenizer
from prefixcache.engine.weight_types import PackedWeight, weight_type


@dataclass(slots=True)
class LoadedModel:
    """Everything the engine needs from a model source."""

    config: ModelConfig
    state_dict: Mapping[str, torch.Tensor]
    tokenizer: Tokenizer
    source: Path
    # HF name -> the GGUF's own blocks of each 2-D weight not in F32 (Q/K rows un-permuted)
    quantized: dict[str, PackedWeight] = field(default_factory=dict)
    # Built already (`engine/weight_cache.py`): the fp32 model on int4 kernels, its int4 names.
    model: torch.nn.Module | None = None
    int4_weights: list[str] = field(default_factory=list)
    # Built from these weights by an engine, by (dtype, on the file's blocks): the next engine
    # shares it (a model's weights are read-only once built; the KV is each engine's own).
    built: dict[tuple[torch.dtype, bool], tuple[torch.nn.Module, list[str]]] = field(
        default_factory=dict, repr=False, compare=False
    )


def load_model(path: str | Path | None = None) -> LoadedModel:
    """Load a GGUF file or a Hugging Face folder; None means the default model."""
    source = model_source(path)
    if source.is_dir():
        return _load_hf_folder(source)
    return _load_gguf(source)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every state-dict name a checkpoint for `config` must have, with its HF shape."""
    targets = build_model(config, device="meta").weight_targets()
    return {name: tuple(target.shape) for name, target in targets.items()}


def check_state_dict(state: Mapping[str, torch.Tensor], config: ModelConfig, source: Path) -> None:
    """Raise ModelFileError naming every missing, unexpected or misshapen tensor."""
    problems = tensor_problems(expected_shapes(config), tensor_shapes(state))
    if problems:
        raise ModelFileError(f"{source}: " + "; ".join(problems))


# ---------------------------------------------------------------- GGUF


def _load_gguf(path: Path) -> LoadedModel:
    reader = open_gguf(path)
    meta = gguf_metadata(reader, path)
    tokenizer = gguf_tokenizer(meta, path)
    tensors = {t.name: t for t in reader.tensors}
    fields = GgufFields(meta, tensors, _gguf_architecture(meta, path), path)
    kind = family(fields.arch)
    assert kind is not None
    config = _gguf_config(fields, kind, tokenizer)
    names = _gguf_names(tensors, config, kind, path)
    _check_types(tensors, names, path)
    permuted = kind.permuted_qk
    blocks = _gguf_blocks(tensors, names, config, permuted)
    dense = {
        hf: _gguf_tensor(tensors[g], config, permuted, path)
        for g, hf in names.items()
        if hf not in blocks
    }  # a packed tensor dequantizes when read, on the native decoders where they load
    state = PackedStateDict(dense, blocks)
    check_state_dict(state, config, path)
    return LoadedModel(config, state, tokenizer, path, blocks)


def _gguf_blocks(
    tensors: dict[str, Any], names: dict[str, str], config: ModelConfig, permuted: bool
) -> dict[str, PackedWeight]:
    """Every 2-D tensor not in F32 as its own blocks (`PackedWeight`), by HF name."""
    f32 = int(gguf.GGMLQuantizationType.F32)
    return {
        hf: _packed(tensors[g], config, permuted)
        for g, hf in names.items()
        if len(tensors[g].shape) == 2 and int(tensors[g].tensor_type) != f32
    }


def _packed(tensor: Any, config: ModelConfig, permuted: bool) -> PackedWeight:
    """A tensor's own blocks in HF layout, Q/K rows un-permuted like `_gguf_tensor`."""
    shape = (int(tensor.shape[1]), int(tensor.shape[0]))
    packed = PackedWeight.from_gguf(tensor.data, tensor.tensor_type, shape, tensor.name)
    for marker, heads in ((".attn_q.", config.num_heads), (".attn_k.", config.num_kv_heads)):
        if permuted and marker in tensor.name:
            packed = packed.take_rows(unpermute_qk(np.arange(shape[0]), heads))
    return packed


def _gguf_config(fields: GgufFields, kind: Family, tokenizer: Tokenizer) -> ModelConfig:
    """ModelConfig from `{arch}.*` metadata and the family's own fields; tied embeddings
    when there is no output.weight."""
    heads, hidden = fields.number("attention.head_count"), fields.number("embedding_length")
    head_dim = int(fields.get("attention.key_length", hidden // heads))
    rotary = int(fields.get("rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise ModelFileError(
            f"{fields.path}: partial RoPE ({rotary} of {head_dim} dims) not supported"
        )
    value_dim = int(fields.get("attention.value_length", head_dim))
    if value_dim != head_dim:
        raise ModelFileError(
            f"{fields.path}: value heads of {value_dim} dims differ from key heads of {head_dim}"
        )
    return _make_config(
        fields.path,
        vocab_size=len(fields.meta["tokenizer.ggml.tokens"]),
        hidden_size=hidden,
        intermediate_size=fields.number("feed_forward_length"),
        num_layers=fields.number("block_count"),
        num_heads=heads,
        num_kv_heads=int(fields.get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=float(fields.get("rope.freq_base", 10000.0)),
        rms_norm_eps=fields.number("attention.layer_norm_rms_epsilon", float),
        max_position_embeddings=fields.number("context_length"),
        tie_word_embeddings="output.weight" not in fields.tensors,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
        name=str(fields.meta.get("general.name") or fields.path.stem),
        revision=_gguf_file_type(fields.meta),
        architecture=fields.arch,
        **kind.config_fields(fields),
    )


def _check_types(tensors: dict[str, Any], names: dict[str, str], path: Path) -> None:
    """ModelFileError naming the first tensor whose type we do not run, and the types we do."""
    for name in names:
        try:
            weight_type(tensors[name].tensor_type, name)
        except ValueError as exc:
            raise ModelFileError(f"{path}: tensor {exc}") from None


def _gguf_architecture(meta: dict[str, Any], path: Path) -> str:
    """The architecture name, if it is one we run; else ModelFileError."""
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or family(arch) is None:
        supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        raise ModelFileError(f"{path}: architecture {arch!r} is not supported (only {supported})")
    return arch


def _gguf_file_type(meta: dict[str, Any]) -> str:
    """The quantization label (e.g. MOSTLY_Q4_1): quantized weights give different KV values."""
    try:
        return gguf.LlamaFileType(int(meta["general.file_type"])).name
    except (KeyError, ValueError, TypeError):
        return ""


def _gguf_names(
    tensors: dict[str, Any], config: ModelConfig, kind: Family, path: Path
) -> dict[str, str]:
    """GGUF tensor name -> HF name; ModelFileError naming missing and unexpected tensors."""
    names = {"token_embd.weight": "model.embed_tokens.weight"}
    names["output_norm.weight"] = "model.norm.weight"
    if not config.tie_word_embeddings:
        names["output.weight"] = "lm_head.weight"
    for i in range(config.num_layers):
        layer = kind.layer_names.items()
        names.update({f"blk.{i}.{g}": f"model.layers.{i}.{h}" for g, h in layer})
    problems = []
    if missing := sorted(set(names) - set(tensors), key=_natural):
        problems.append(f"missing tensors {short_list(missing)}")
    if extra := sorted(set(tensors) - set(names) - kind.consumed, key=_natural):
        problems.append(f"unexpected tensors {short_list(extra)}")
    if problems:
        raise ModelFileError(f"{path}: " + "; ".join(problems))
    return names


def _gguf_tensor(tensor: Any, config: ModelConfig, permuted: bool, path: Path) -> torch.Tensor:
    """One tensor as float32 in HF layout ([out_features, in_features]); Q/K rows that
    llama.cpp's converter `permuted` for Llama's RoPE are put back."""
    shape = tuple(int(d) for d in reversed(tensor.shape))  # ggml lists the fastest dim first
    try:
        values = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
    except (NotImplementedError, ValueError) as exc:
        kind = getattr(tensor.tensor_type, "name", tensor.tensor_type)
        raise ModelFileError(f"{path}: cannot dequantize {tensor.name} ({kind}): {exc}") from exc
    if permuted and ".attn_q." in tensor.name:
        values = unpermute_qk(values, config.num_heads)
    elif permuted and ".attn_k." in tensor.name:
        values = unpermute_qk(values, config.num_kv_heads)
    # Dequantized arrays are fresh; F32 ones are read-only views of the file and get copied.
    return torch.from_numpy(np.require(values, np.float32, ["C", "W"]))


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
    if raw.get("model_type") != "llama":
        raise ModelFileError(
            f"{path}: model_type {raw.get('model_type')!r} is not supported in a Hugging Face "
            "folder (only 'llama'; other families load from their GGUF file)"
        )
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
