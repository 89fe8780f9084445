"""transformers' own GGUF loading, minus the work it repeats: the references of the exactness
tests (the default model's weights and tokenizer) come from it unchanged, in a third of the time.

transformers parses the whole GGUF (its 49,152-entry vocabulary through numpy memmap slices)
once for the config, again for the weights and again for the tokenizer, and rebuilds gguf's
tensor-name map for every submodule of the model (~400 times). Here each file is parsed once
per session by gguf's own ``GGUFReader`` and the name map is built once per architecture:
the same reader objects and the same maps, so the same tensors and tokenizer (measured: the
reference's state dict and the tokenizer's JSON are byte-identical with and without this).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import gguf
import pytest

_GGUFReader = gguf.GGUFReader
_tensor_name_map = cache(gguf.get_tensor_name_map)


@cache
def _read(path: Path) -> gguf.GGUFReader:
    return _GGUFReader(path)


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
