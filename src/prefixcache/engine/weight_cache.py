"""A GGUF's ready-to-run int4 model, built once and kept in a cache folder.

Building the engine's model from a GGUF (parse the vocabulary, dequantize, pack every Q4
matrix for torch's int4 kernel, compute `W'` and the head's norms) takes seconds; reading
the result back takes a fraction of one. One safetensors file per model, named by a key over
the GGUF's digest (size, mtime, sampled bytes), this format's version and the torch version
(whose int4 packing it stores); its metadata holds the key, the config, the tokenizer and a
digest of every tensor's bytes. Nothing in the file is trusted: the digest, the key, and
every tensor's name, dtype and shape are checked, and any mismatch means a rebuild. Files
are written atomically (a temporary file, then a rename); a folder that cannot be written
only costs the next start the slow path. Tensors are read mapped from the file, not copied.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer as Backend

from prefixcache.engine.config import ModelConfig
from prefixcache.engine.fused_decode import projections
from prefixcache.engine.model_files import model_source
from prefixcache.engine.models import build_model
from prefixcache.engine.models.llama import LlamaModel
from prefixcache.engine.packed import load_packed, packed_tensors
from prefixcache.engine.quant import Int4Linear
from prefixcache.engine.tokenizer import Tokenizer
from prefixcache.engine.weight_types.linear import PackedLinear
from prefixcache.engine.weights import LoadedModel, load_model
from prefixcache.progress import Ticking, progress_bar

FORMAT = 4  # bump whenever what is stored, or how the packing code computes it, changes
_HEAD, _SAMPLE, _SAMPLES = 2**20, 64 * 2**10, 32  # the GGUF's cheap digest

log = logging.getLogger(__name__)
EVENTS: Counter[str] = Counter()  # hit, built, rebuilt (a bad file), unwritable


class CacheFileError(ValueError):
    """A cache file that is truncated, corrupt, or for another model or packing."""


def load_serving_model(path: str | Path | None, folder: Path | None) -> LoadedModel:
    """The model with its int4 model built (fp32, int4 kernels), from ``folder`` if it holds
    a good file for it; else built and stored there. None, or an HF folder: no cache."""
    source = model_source(path)
    if folder is None or source.is_dir():
        return build(source)
    key = cache_key(source)
    file = folder / f"weights-{key[:40]}.safetensors"
    try:
        loaded = read_file(file, key, source)
        EVENTS["hit"] += 1
        return loaded
    except (FileNotFoundError, NotADirectoryError):
        EVENTS["built"] += 1
    except (CacheFileError, OSError) as error:
        EVENTS["rebuilt"] += 1
        log.warning("weight cache %s: %s; rebuilding it", file, error)
    loaded = build(source)
    if not cacheable(loaded):
        log.info("weight cache: %s's family is built at each start (not stored yet)", source.name)
        return loaded
    try:
        write_file(file, key, loaded)
    except OSError as error:
        EVENTS["unwritable"] += 1
        log.warning("weight cache %s not written (%s): the next start builds again", file, error)
    return loaded


def cacheable(loaded: LoadedModel) -> bool:
    """Whether a built model can be stored: a plain Llama whose projections are each one
    int4 or one GGUF matrix (what `packed.py` knows)."""
    model = loaded.model
    return (
        isinstance(model, LlamaModel)
        and _plain_llama(loaded.config)
        and all(isinstance(p, Int4Linear | PackedLinear) for p in projections(model))
    )


def _plain_llama(config: ModelConfig) -> bool:
    """A Llama without bias, QK-norms or a window: the layers `packed.py` stores."""
    c = config
    return c.architecture == "llama" and not (c.attention_bias or c.qk_norm or c.sliding_window)


def build(source: Path) -> LoadedModel:
    """The slow path: read the model and build its int4 model in fp32 (a bar over the
    packed tensors on a terminal)."""
    loaded = load_model(source)
    model = build_model(loaded.config)
    with progress_bar(len(loaded.quantized), f"packing {source.name}", "tensor") as advance:
        blocks = loaded.quantized if advance is None else Ticking(loaded.quantized, advance)
        loaded.int4_weights = model.load_quantized(loaded.state_dict, blocks)
    loaded.model, loaded.state_dict, loaded.quantized = model, {}, {}
    return loaded


def cache_key(source: Path) -> str:
    """Hex key: FORMAT, the torch version, and the GGUF's cheap digest (its size and mtime,
    its first MiB, and 64 KiB at each of 32 places spread over the rest)."""
    name, hasher = _hasher()
    stat = source.stat()
    with source.open("rb") as f:
        hasher.update(f.read(_HEAD))
        for i in range(_SAMPLES):
            f.seek(stat.st_size * i // _SAMPLES)
            hasher.update(f.read(_SAMPLE))
    parts = f"{FORMAT}|torch {torch.__version__}|{name}|{stat.st_size}|{stat.st_mtime_ns}|"
    return hashlib.sha256(parts.encode() + hasher.digest()).hexdigest()


def _hasher() -> tuple[str, Any]:
    """xxh3-128 when installed (prefixcache[fast-hash]): ~8x faster than SHA-256 here."""
    try:
        import xxhash
    except ImportError:
        return "sha256", hashlib.sha256()
    return "xxh3_128", xxhash.xxh3_128()


# ---------------------------------------------------------------- writing


def write_file(file: Path, key: str, loaded: LoadedModel) -> None:
    """Store ``loaded``'s built model under ``file`` (safetensors), atomically."""
    assert loaded.model is not None
    tensors = {k: v.contiguous() for k, v in sorted(packed_tensors(loaded.model).items())}
    metadata = {"prefixcache": json.dumps(_header(key, loaded)), "digest": _digest(tensors)}
    file.parent.mkdir(parents=True, exist_ok=True)
    temporary = file.with_name(f".{file.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, temporary, metadata=metadata)
        with temporary.open("rb") as f:
            os.fsync(f.fileno())
        os.replace(temporary, file)
    finally:
        temporary.unlink(missing_ok=True)


def _header(key: str, loaded: LoadedModel) -> dict[str, Any]:
    """What the file says besides its tensors: key, config, tokenizer, int4 names."""
    tokenizer = loaded.tokenizer
    return {
        "key": key,
        "config": dataclasses.asdict(loaded.config),
        "tokenizer": {
            "backend": tokenizer.backend.to_str(),
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_ids": list(tokenizer.eos_token_ids),
            "chat_template": tokenizer.chat_template,
            "special_tokens": tokenizer.special_tokens,
        },
        "int4_weights": loaded.int4_weights,
    }


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    """The hash of every tensor's name, dtype, shape and bytes, in name order."""
    name, hasher = _hasher()
    for key in sorted(tensors):
        tensor = tensors[key]
        hasher.update(f"{key}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        if tensor.numel():
            hasher.update(memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()))
    return f"{name}:{hasher.hexdigest()}"


# ---------------------------------------------------------------- reading


def read_file(file: Path, key: str, source: Path) -> LoadedModel:
    """The model stored in ``file``; CacheFileError unless every check passes."""
    header, tensors = _read(file, key)
    try:
        config = _config(header["config"])
        tokenizer = _tokenizer(header["tokenizer"])
        int4 = [str(n) for n in header["int4_weights"]]
        model = LlamaModel(config)
        load_packed(model, tensors)
    except Exception as error:  # anything malformed in a file we did not just write
        raise CacheFileError(f"unusable contents ({type(error).__name__}: {error})") from None
    return LoadedModel(config, {}, tokenizer, source, model=model, int4_weights=int4)


def _read(file: Path, key: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Header and tensors (mapped from the file), after the key and digest checks."""
    if not file.is_file():
        raise FileNotFoundError(file)
    try:
        with safe_open(file, "pt") as f:
            metadata = f.metadata() or {}
            header = json.loads(metadata.get("prefixcache", "null"))
            if not isinstance(header, dict) or header.get("key") != key:
                raise CacheFileError("built from another model file or packing version")
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    except CacheFileError:
        raise
    except (SafetensorError, OSError, ValueError) as error:
        raise CacheFileError(f"not a readable weight cache file ({error})") from None
    if metadata.get("digest") != _digest(tensors):
        raise CacheFileError("digest mismatch (truncated or corrupt)")
    return header, tensors


def _config(fields: dict[str, Any]) -> ModelConfig:
    lists = ("eos_token_ids", "rope_freq_factors", "window_layers")
    return ModelConfig(**{**fields, **{k: tuple(fields.get(k, ())) for k in lists}})


def _tokenizer(state: dict[str, Any]) -> Tokenizer:
    return Tokenizer(
        Backend.from_str(state["backend"]),
        bos_token_id=state["bos_token_id"],
        eos_token_ids=[int(i) for i in state["eos_token_ids"]],
        chat_template=state["chat_template"],
        special_tokens=dict(state["special_tokens"]),
    )
