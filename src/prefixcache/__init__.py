"""prefixcache: a paged KV cache with automatic prefix caching."""

from prefixcache.cache import (
    CacheStats,
    CapacityError,
    KVCacheManager,
    MultiModalItem,
    Namespace,
    Sequence,
)

__all__ = [
    "CacheStats",
    "CapacityError",
    "KVCacheManager",
    "MultiModalItem",
    "Namespace",
    "Sequence",
]
__version__ = "0.1.0"
