"""KV events: what the cache reports about content entering and leaving a medium.

The records mirror vLLM's KV events (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``) so a router built for vLLM can read ours; the server encodes them on
the wire (``prefixcache.server.events``). Digests are the portable SHA-256 chain, never
token ids unless the operator asks for them; salts never appear.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from prefixcache.cache.common import DEFAULT_BLOCK_SIZE

MEDIUM_POOL = "cpu"  # the in-memory pool next to the model (vLLM names its own "GPU")


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks that became matchable in ``medium``, a chain hanging from ``parent_block_hash``."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int] = field(default_factory=list)  # empty unless explicitly enabled
    block_size: int = DEFAULT_BLOCK_SIZE
    lora_id: int | None = None
    medium: str | None = MEDIUM_POOL


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """The last copy of each content left ``medium`` (a duplicate still held sends nothing)."""

    block_hashes: list[bytes]
    medium: str | None = MEDIUM_POOL


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every block of the pool was dropped (``reset``)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventSink(Protocol):
    """Where the cache sends its events; called on the thread that drives the cache."""

    def __call__(self, event: KVEvent) -> None: ...
