"""KV events: what the cache reports about content entering and leaving a medium.

The records mirror vLLM's KV events (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``) so a router built for vLLM can read ours; the protocol layer encodes
them on the wire (``prefixcache.protocol.kv_events``). Digests are the portable SHA-256
chain, never token ids unless the operator asks for them; salts never appear.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from prefixcache.cache.common import DEFAULT_BLOCK_SIZE

if TYPE_CHECKING:
    from prefixcache.cache.block_pool import BlockPool
    from prefixcache.cache.blocks import Block

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
    kv_cache_dtype: str | None = None  # what the blocks' K/V are stored as (ours, not vLLM's)


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


class RemovalReporter:
    """Sends ``BlockRemoved`` when the last indexed copy of a digest leaves the pool.

    A listener on the pool's lists while events are on (``KVCacheManager.set_event_sink``);
    a pool without one pays nothing. Digests are counted, not uids: an orphan left indexed
    below an evicted parent has the digest its recomputation gets, so one digest can be
    indexed twice.
    """

    def __init__(self, pool: BlockPool, sink: EventSink) -> None:
        self.pool = pool
        self.sink = sink
        self.counts = Counter(block.digest for block in pool.cached.values())
        pool.on_index.append(self.indexed)
        pool.on_evict.append(self.evicting)
        pool.on_clear.append(self.cleared)

    def detach(self) -> None:
        """Stop listening (events turned off or sent elsewhere)."""
        self.pool.on_index.remove(self.indexed)
        self.pool.on_evict.remove(self.evicting)
        self.pool.on_clear.remove(self.cleared)

    def indexed(self, block: Block) -> None:
        self.counts[block.digest] += 1

    def evicting(self, block: Block) -> None:
        """An indexed copy is evicted: report its digest unless a copy of it stays indexed."""
        if block.uid in self.pool.duplicates:
            return  # a held duplicate takes its place in the index
        counts, digest = self.counts, block.digest
        counts[digest] -= 1
        if not counts[digest]:
            del counts[digest]
            self.sink(BlockRemoved([digest]))

    def cleared(self) -> None:
        self.counts.clear()
