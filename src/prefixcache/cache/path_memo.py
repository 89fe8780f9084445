"""The last matched path per extra keys: a repeated prefix skips the dict walk.

Most traffic that hits at all repeats a recent prefix (a system prompt, a chat history).
For that part of a prompt, one ``startswith`` (a memcmp) and one C-level comparison of
content ids replace hundreds of dict lookups. Safe by construction: content ids (uids)
are never reused, so a remembered block whose uid is unchanged still holds exactly the
remembered tokens and is still the indexed copy; the first changed uid ends the recall.
"""

from __future__ import annotations

from operator import attrgetter

from prefixcache.cache.blocks import Block

BLOCK_UID = attrgetter("uid")


class PathMemo:
    """A bounded map: extra-keys -> (prefix bytes, blocks, their uids at the time)."""

    def __init__(self, capacity: int = 64) -> None:
        self.capacity = capacity
        self._paths: dict[object, tuple[bytes, list[Block], list[int]]] = {}

    def recall(
        self, key: object, token_bytes: bytes, max_blocks: int, step: int
    ) -> tuple[list[Block], list[int]]:
        """The longest still-valid remembered path that ``token_bytes`` starts with."""
        path = self._paths.get(key)
        if path is None:
            return [], []
        prefix, blocks, uids = path
        count = min(len(blocks), max_blocks)
        if not token_bytes.startswith(prefix[: count * step] if count < len(blocks) else prefix):
            count = _common_blocks(token_bytes, prefix, count, step)
        blocks, uids = blocks[:count], uids[:count]
        if list(map(BLOCK_UID, blocks)) != uids:  # something was evicted: stop there
            count = next(i for i, (b, u) in enumerate(zip(blocks, uids, strict=True)) if b.uid != u)
            blocks, uids = blocks[:count], uids[:count]
        return blocks, uids

    def remember(
        self, key: object, token_bytes: bytes, blocks: list[Block], uids: list[int], step: int
    ) -> None:
        """Store a matched path as the most recent one for ``key``."""
        if not blocks:
            return
        self._paths.pop(key, None)
        if len(self._paths) >= self.capacity:
            del self._paths[next(iter(self._paths))]  # the least recently stored
        self._paths[key] = (token_bytes[: len(blocks) * step], blocks, uids)

    def clear(self) -> None:
        """Forget every path."""
        self._paths.clear()

    def __len__(self) -> int:
        return len(self._paths)


def _common_blocks(token_bytes: bytes, prefix: bytes, limit: int, step: int) -> int:
    """Whole blocks (at most ``limit``) that ``token_bytes`` shares with ``prefix``."""
    low, high = 0, limit  # invariant: the first `low` blocks agree
    while low < high:
        middle = (low + high + 1) // 2
        if token_bytes.startswith(prefix[: middle * step]):
            low = middle
        else:
            high = middle - 1
    return low
