"""The cache core: pure Python, no torch, no I/O. The engine and the simulator drive it."""

from prefixcache.cache.hashing import MultiModalItem as MultiModalItem
from prefixcache.cache.hashing import Namespace as Namespace
from prefixcache.cache.manager import KVCacheManager as KVCacheManager
from prefixcache.cache.sequence import Sequence as Sequence
from prefixcache.cache.stats import CacheStats as CacheStats
from prefixcache.cache.validation import CapacityError as CapacityError
