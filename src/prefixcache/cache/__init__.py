"""The cache core: pure Python, no torch, no I/O. The engine and the simulator drive it."""

from prefixcache.cache.hashing import MultiModalItem, Namespace
from prefixcache.cache.manager import KVCacheManager
from prefixcache.cache.sequence import Sequence
from prefixcache.cache.stats import CacheStats
from prefixcache.cache.validation import CapacityError

__all__ = [
    "CacheStats",
    "CapacityError",
    "KVCacheManager",
    "MultiModalItem",
    "Namespace",
    "Sequence",
]
