"""prefixcache: a paged KV cache with automatic prefix caching, and an engine on it."""

from prefixcache.cache import (
    CacheStats,
    CapacityError,
    KVCacheManager,
    MultiModalItem,
    Namespace,
    Sequence,
)

__all__ = [
    "LLM",
    "CacheStats",
    "CapacityError",
    "KVCacheManager",
    "MultiModalItem",
    "Namespace",
    "SamplingParams",
    "Sequence",
]
__version__ = "0.1.0"

_ENGINE_EXPORTS = {
    "LLM": "prefixcache.engine.llm",
    "SamplingParams": "prefixcache.engine.sampling",
}


def __getattr__(name: str) -> object:
    """Import the engine (and torch) only when it is asked for."""
    if name in _ENGINE_EXPORTS:
        import importlib

        return getattr(importlib.import_module(_ENGINE_EXPORTS[name]), name)
    raise AttributeError(f"module 'prefixcache' has no attribute {name!r}")
