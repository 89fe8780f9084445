"""transformers' own GGUF loading, minus the work it repeats: the references of the exactness
tests (the default model's weights and tokenizer) come from it unchanged, in a third of the time.

transformers parses the whole GGUF (its 49,152-entry vocabulary through numpy memmap slices)
once for the config, again for the weights and again for the tokenizer, and rebuilds gguf's
tensor-name map for every submodule of the model (~400 times). Here each file is parsed once
per session by gguf's own ``GGUFReader`` (its parsing unchanged, over a plain ndarray view of the
memmap: ``_ArrayReader``) and the name map is built once per architecture:
the same reader objects and the same maps, so the same tensors and tokenizer (measured: the
reference's state dict and the tokenizer's JSON are byte-identical with and without this).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import gguf
import numpy as np
import pytest

_tensor_name_map = cache(gguf.get_tensor_name_map)


class _ArrayReader(gguf.GGUFReader):
    """gguf's reader, its parsing unchanged, over a plain ndarray view of its memmap: the
    same bytes, but a slice no longer runs memmap's Python-level ``__array_finalize__``, and
    the reader slices once per vocabulary string (Gemma 3's file: 11.7 -> 4.1 s, measured;
    every field's contents and every tensor's data equal)."""

    @property
    def data(self) -> np.ndarray:
        return self._array

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._array = value.view(np.ndarray)


@cache
def _read(path: Path) -> gguf.GGUFReader:
    return _ArrayReader(path)


def gguf_reader(path: str | Path, mode: str = "r") -> gguf.GGUFReader:
    """gguf's own reader of ``path``, parsed once per session (read-only: it is shared)."""
    assert mode == "r", "a shared reader is read-only"
    return _read(Path(path).resolve())


@contextmanager
def transformers_gguf_once() -> Iterator[None]:
    """Within: transformers' GGUF loaders read each file through ``gguf_reader`` and build
    each tensor-name map once (both are imported from ``gguf`` when they are called)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", gguf_reader)
        patch.setattr(gguf, "get_tensor_name_map", _tensor_name_map)
        yield
