"""A GGUF's ready-to-run int4 model, built once and kept in a cache folder.

Building the engine's model from a GGUF (parse the vocabulary, dequantize, pack every Q4
matrix for torch's int4 kernel, compute `W'` and the head's norms) takes seconds; reading
the result back takes a fraction of one. One file per model, named by a key over the GGUF's
digest (size, mtime, sampled bytes), this file's format version and the torch version (whose
int4 packing it stores). Nothing in the file is trusted: a digest over all of it, the key, and every
tensor's name, dtype and shape are checked, and any mismatch means a rebuild. Files are
written atomically (a temporary file, then a rename); a folder that cannot be written
only costs the next start the slow path.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import mmap
import os
import struct
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer as Backend

from prefixcache.engine.config import ModelConfig
from prefixcache.engine.fused_decode import fused_supported
from prefixcache.engine.model_files import model_source
from prefixcache.engine.models import build_model
from prefixcache.engine.models.llama import LlamaModel
from prefixcache.engine.packed import load_packed, packed_tensors
from prefixcache.engine.tokenizer import Tokenizer
from prefixcache.engine.weights import LoadedModel, load_model

FORMAT = 1  # bump whenever what is stored, or how the packing code computes it, changes
MAGIC = b"PCWEIGHTS\n"
ALIGN = 64  # bytes: each tensor starts on a multiple
MAX_HEADER = 64 * 2**20  # bytes of JSON header a file may claim
_CHUNK = 16 * 2**20
_HEAD, _SAMPLE, _SAMPLES = 2**20, 64 * 2**10, 32  # the GGUF's cheap digest
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.uint8)}

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
    file = folder / f"weights-{key[:40]}.bin"
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
    """Whether a built model can be stored: a plain Llama (what `packed.py` knows)."""
    return isinstance(loaded.model, LlamaModel) and fused_supported(loaded.config)


def build(source: Path) -> LoadedModel:
    """The slow path: read the model and build its int4 model in fp32."""
    loaded = load_model(source)
    model = build_model(loaded.config)
    model.load_weights(loaded.state_dict)
    loaded.int4_weights = model.quantize(loaded.quantized)
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
    """Store ``loaded``'s built model under ``file``, atomically."""
    assert loaded.model is not None
    named = sorted(packed_tensors(loaded.model).items())
    tensors = {k: v.contiguous().reshape(-1).view(torch.uint8) for k, v in named}
    header = _header(key, loaded, named, tensors)
    file.parent.mkdir(parents=True, exist_ok=True)
    temporary = file.with_name(f".{file.name}.{os.getpid()}.tmp")
    try:
        with temporary.open("wb") as f:
            _write(f, header, tensors)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, file)
    finally:
        temporary.unlink(missing_ok=True)


def _header(
    key: str,
    loaded: LoadedModel,
    named: list[tuple[str, torch.Tensor]],
    raw: dict[str, torch.Tensor],
) -> bytes:
    """The JSON header: key, config, tokenizer, int4 names, and each tensor's place."""
    shapes, offset = {}, 0
    for name, tensor in named:
        dtype = str(tensor.dtype).removeprefix("torch.")
        shapes[name] = [dtype, list(tensor.shape), offset, raw[name].numel()]
        offset += _aligned(raw[name].numel())
    tokenizer = loaded.tokenizer
    header = {
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
        "tensors": shapes,
        "data_bytes": offset,
    }
    return json.dumps(header).encode()


def _write(f: Any, header: bytes, raw: dict[str, torch.Tensor]) -> None:
    """MAGIC, header length, header, padding, tensors (each aligned), digest of all before."""
    _, hasher = _hasher()
    start = len(MAGIC) + 8 + len(header)
    prefix = MAGIC + struct.pack("<Q", len(header)) + header + bytes(_aligned(start) - start)
    for part in (prefix, *(_padded(raw[name]) for name in sorted(raw))):
        hasher.update(part)
        f.write(part)
    f.write(hasher.digest())


def _padded(tensor: torch.Tensor) -> bytes | memoryview:
    data = memoryview(tensor.numpy())
    pad = _aligned(len(data)) - len(data)
    return bytes(data) + bytes(pad) if pad else data


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


# ---------------------------------------------------------------- reading


def read_file(file: Path, key: str, source: Path) -> LoadedModel:
    """The model stored in ``file``; CacheFileError unless every check passes."""
    buffer = _read_all(file)
    header, data_start = _parse(buffer, key)
    try:
        config = _config(header["config"])
        tokenizer = _tokenizer(header["tokenizer"])
        int4 = [str(n) for n in header["int4_weights"]]
        tensors = _views(buffer, data_start, header["tensors"], header["data_bytes"])
        model = LlamaModel(config)
        load_packed(model, tensors)
    except CacheFileError:
        raise
    except Exception as error:  # anything malformed in a file we did not just write
        raise CacheFileError(f"unusable contents ({type(error).__name__}: {error})") from None
    return LoadedModel(config, {}, tokenizer, source, model=model, int4_weights=int4)


def _read_all(file: Path) -> mmap.mmap:
    """The whole file mapped copy-on-write: tensors view it with no copy, and replicas on one
    machine share its pages (the writer only ever renames a new file in, never truncates)."""
    with file.open("rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise CacheFileError("empty file")
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)


def _parse(buffer: mmap.mmap, key: str) -> tuple[dict[str, Any], int]:
    """Check magic, digest and key; the header and where the tensor data starts."""
    name, hasher = _hasher()
    tail = hasher.digest_size
    if len(buffer) < len(MAGIC) + 8 + tail or buffer[: len(MAGIC)] != MAGIC:
        raise CacheFileError("not a weight cache file (bad magic or truncated)")
    (length,) = struct.unpack_from("<Q", buffer, len(MAGIC))
    if length > min(MAX_HEADER, len(buffer)):
        raise CacheFileError(f"header of {length} bytes claimed")
    view = memoryview(buffer)
    for start in range(0, len(buffer) - tail, _CHUNK):
        hasher.update(view[start : min(start + _CHUNK, len(buffer) - tail)])
    if hasher.digest() != bytes(view[-tail:]):
        raise CacheFileError(f"{name} digest mismatch (truncated or corrupt)")
    try:
        header = json.loads(bytes(view[len(MAGIC) + 8 : len(MAGIC) + 8 + length]))
        data_start = _aligned(len(MAGIC) + 8 + length)
        if header["key"] != key:
            raise CacheFileError("built from another model file or packing version")
        if data_start + int(header["data_bytes"]) + tail != len(buffer):
            raise CacheFileError("size does not match its header")
    except CacheFileError:
        raise
    except (ValueError, KeyError, TypeError) as error:
        raise CacheFileError(f"bad header ({error})") from None
    return header, data_start


def _views(
    buffer: mmap.mmap, data_start: int, places: dict[str, Any], data_bytes: int
) -> dict[str, torch.Tensor]:
    """Tensors viewing ``buffer`` (no copy), each inside the data section."""
    tensors = {}
    for name, (dtype_name, shape, offset, nbytes) in places.items():
        dtype = _DTYPES[dtype_name]
        count = nbytes // dtype.itemsize
        numel = math.prod(int(dim) for dim in shape)
        if numel != count or nbytes % dtype.itemsize or not 0 <= offset <= data_bytes - nbytes:
            raise CacheFileError(f"tensor {name} does not fit its place")
        if count == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        flat = torch.frombuffer(buffer, dtype=dtype, count=count, offset=data_start + offset)
        tensors[name] = flat.view(shape)
    return tensors


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
