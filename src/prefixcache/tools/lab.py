"""The article's CPU lab, run through the real KVCacheManager instead of a toy chain."""

from __future__ import annotations

from prefixcache.cache import KVCacheManager
from prefixcache.cache.common import cdiv

BASE = list(range(1, 13))
SAME_PREFIX = list(range(1, 9)) + [90, 91, 92, 93]
CHANGED_ONE = [1, 2, 3, 4, 5, 6, 99, 8, 90, 91, 92, 93]


def reusable(
    first: list[int],
    second: list[int],
    block_size: int,
    salt_first: str | None,
    salt_second: str | None,
) -> tuple[int, int]:
    """Cache ``first`` (computed, then freed); return (blocks, tokens) ``second`` reuses."""
    manager = KVCacheManager(num_blocks=cdiv(len(first), block_size), block_size=block_size)
    seq = manager.admit("first", first, cache_salt=salt_first)
    assert seq is not None
    manager.commit(seq, len(first))
    manager.free(seq)
    tokens = manager.match(second, cache_salt=salt_second)
    manager.check_invariants()
    return tokens // block_size, tokens


def run(block_size: int = 4, use_salt: bool = True) -> list[str]:
    """The lab's three result lines."""
    salt_a, salt_b = ("tenant-a", "tenant-b") if use_salt else (None, None)
    same_salt = salt_a
    return [
        f"same prefix: {reusable(BASE, SAME_PREFIX, block_size, same_salt, same_salt)}",
        f"one token changed: {reusable(BASE, CHANGED_ONE, block_size, same_salt, same_salt)}",
        f"different salt: {reusable(BASE, SAME_PREFIX, block_size, salt_a, salt_b)}",
    ]
