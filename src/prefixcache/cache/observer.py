"""Debug hooks: what the manager tells an observer, and a key-component log built on them.

The log follows the article's debugging advice: record the key's components (namespace,
block index, parent digest, token count, hit or miss, refcount, physical block id), never
the tokens themselves. Digests are shortened; salts appear only as a digest of the salt.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Protocol

from prefixcache.cache.blocks import Block
from prefixcache.cache.common import TOKEN_BYTES
from prefixcache.cache.sequence import Sequence

SHORT_HEX = 12  # 48 bits: enough to join lines, too short to be a portable key


class CacheObserver(Protocol):
    """Called by ``KVCacheManager`` once per admission and free, and by the pool per eviction."""

    def admitted(self, seq: Sequence, num_hit_blocks: int) -> None: ...

    def freed(self, seq: Sequence) -> None: ...

    def evicted(self, block: Block) -> None: ...


def short(digest: bytes | None) -> str | None:
    """The first SHORT_HEX hex digits of a digest."""
    return None if digest is None else digest.hex()[:SHORT_HEX]


def salt_digest(salt: str | None) -> str | None:
    """A short SHA-256 of a cache salt: tells tenants apart without revealing the salt."""
    return None if salt is None else hashlib.sha256(salt.encode()).hexdigest()[:8]


class KeyLogObserver:
    """Writes one JSON line per looked-up full block and per eviction; never token ids."""

    def __init__(self, write: Callable[[str], object], namespace_digest: bytes) -> None:
        self._write = write
        self._root = namespace_digest
        self._namespace = short(namespace_digest)
        self._last_holder: dict[int, dict] = {}  # block id -> its key components, at free

    def admitted(self, seq: Sequence, num_hit_blocks: int) -> None:
        """A lookup line for each full prompt block: hit (reused) or miss (to compute)."""
        digests = seq.full_block_digests()[: seq.num_prompt_tokens // seq.block_size]
        lines = []
        for index, digest in enumerate(digests):
            block = seq.blocks[index]
            parent = digests[index - 1] if index else self._root
            record = {
                "event": "lookup",
                **self._components(seq, index, parent),
                "digest": short(digest),
                "result": "hit" if index < num_hit_blocks else "miss",
                "refcount": block.ref_cnt,
                "block_id": block.block_id,
            }
            lines.append(json.dumps(record))
        self._write("".join(line + "\n" for line in lines))

    def freed(self, seq: Sequence) -> None:
        """Remember the key components of each indexed block, for its eviction line."""
        for index, block in enumerate(seq.blocks):
            if block.key is not None:
                parent = seq.blocks[index - 1].digest if index else self._root
                self._last_holder[block.block_id] = self._components(seq, index, parent)

    def evicted(self, block: Block) -> None:
        """An eviction line: the evicted content's components and its last holder."""
        holder = self._last_holder.pop(block.block_id, None) or {"namespace": self._namespace}
        record = {
            "event": "evict",
            **holder,
            "digest": short(block.digest),
            "tokens": len(block.key[1]) // TOKEN_BYTES if block.key else None,
            "refcount": block.ref_cnt,
            "block_id": block.block_id,
        }
        self._write(json.dumps(record) + "\n")

    def _components(self, seq: Sequence, index: int, parent: bytes | None) -> dict:
        return {
            "request": seq.request_id,
            "namespace": self._namespace,
            "salt": salt_digest(seq.cache_salt),
            "block_index": index,
            "parent": short(parent),
            "tokens": seq.block_size,
        }
