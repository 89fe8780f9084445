"""KV events: what the cache reports about content entering and leaving a medium.

The records mirror vLLM's KV events (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``) so a router built for vLLM can read ours; the protocol layer encodes
them on the wire (``prefixcache.protocol.kv_events``). Digests are the portable SHA-256
chain, never token ids unless the operator asks for them; salts never appear. Each event
names its KV cache group as vLLM's do: ``group_idx`` 0 is the full layers; a hybrid pool's
window group g is ``group_idx`` g + 1, of kind ``sliding_window``.
"""

from __future__ import annotations

import struct
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from prefixcache.cache.common import DEFAULT_BLOCK_SIZE, TOKEN_BYTES

if TYPE_CHECKING:
    from prefixcache.cache.block_pool import BlockPool
    from prefixcache.cache.blocks import Block
    from prefixcache.cache.window_pages import WindowPages

MEDIUM_POOL = "cpu"  # the in-memory pool next to the model (vLLM names its own "GPU")
FULL_ATTENTION = "full_attention"  # vLLM's kv_cache_spec_kind of a group keeping every token
SLIDING_WINDOW = "sliding_window"  # ... and of one keeping the last window tokens


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
    group_idx: int = 0  # the KV cache group (0: the full layers)
    kv_cache_spec_kind: str = FULL_ATTENTION  # the group's kind, so a reader can classify it
    kv_cache_spec_sliding_window: int | None = None  # a window group's window, in tokens


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """The last copy of each content left ``medium`` (a duplicate still held sends nothing)."""

    block_hashes: list[bytes]
    medium: str | None = MEDIUM_POOL
    group_idx: int = 0  # the KV cache group it left (its kind came with its BlockStored)


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


class WindowReporter:
    """A hybrid pool's window groups' events: ``(digest, g)`` is held while an indexed
    logical block has a page attached in window group g (sent as ``group_idx`` g + 1).

    ``WindowPages`` and ``BlockPool`` call it on attaching to, detaching from and evicting an
    indexed block and on a promotion; the manager announces newly indexed blocks' runs
    (``announce``). Holders are counted as ``RemovalReporter`` counts digests: an orphan and
    its recomputation can both hold a digest's page in a group.
    """

    def __init__(
        self,
        pool: BlockPool,
        windows: WindowPages,
        sink: EventSink,
        *,
        token_ids: bool = False,
        kv_cache_dtype: str | None = None,
    ) -> None:
        self.pool, self.windows, self.sink = pool, windows, sink
        self.token_ids = token_ids
        self.kv_cache_dtype = kv_cache_dtype
        self.counts: Counter[tuple[bytes, int]] = Counter()
        for block_id, pages in windows.attached.items():
            logical = pool.blocks[block_id]
            if logical.key is not None:
                for group, page in enumerate(pages):
                    if page is not None:
                        self.counts[(logical.digest, group)] += 1
        windows.reporter = self
        pool.on_clear.append(self.cleared)

    def detach(self) -> None:
        """Stop reporting (events turned off or sent elsewhere)."""
        self.windows.reporter = None
        self.pool.on_clear.remove(self.cleared)

    def announce(
        self, group: int, hashes: list[bytes], parent: bytes | None, token_ids: list[int]
    ) -> None:
        """Newly indexed blocks with a page in ``group``: one chain, as group 0 sends it."""
        for digest in hashes:
            self.counts[(digest, group)] += 1
        self.sink(self._stored(group, hashes, parent, token_ids))

    def attached(self, logical: Block, group: int) -> None:
        """Indexed ``logical`` got a page in ``group`` (a duplicate's, adopted)."""
        digest = logical.digest
        assert digest is not None, "an indexed block has a digest"
        self.counts[(digest, group)] += 1
        tokens = _block_tokens(logical) if self.token_ids else []
        self.sink(self._stored(group, [digest], None, tokens))

    def promoted(self, heir: Block) -> None:
        """A held duplicate became the indexed copy: its attached pages are matchable now."""
        for group in range(self.windows.num_groups):
            if self.windows.page(heir, group) is not None:
                self.attached(heir, group)

    def detached(self, logical: Block, group: int) -> None:
        """Indexed ``logical`` lost its page in ``group`` (evicted, or with the block)."""
        key = (logical.digest, group)
        counts = self.counts
        counts[key] -= 1
        if not counts[key]:
            del counts[key]
            self.sink(BlockRemoved([key[0]], MEDIUM_POOL, group + 1))

    def cleared(self) -> None:
        self.counts.clear()

    def _stored(
        self, group: int, hashes: list[bytes], parent: bytes | None, token_ids: list[int]
    ) -> BlockStored:
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=token_ids,
            block_size=self.windows.block_size,
            medium=MEDIUM_POOL,
            kv_cache_dtype=self.kv_cache_dtype,
            group_idx=group + 1,
            kv_cache_spec_kind=SLIDING_WINDOW,
            kv_cache_spec_sliding_window=self.windows.windows[group],
        )


def _block_tokens(block: Block) -> list[int]:
    """An indexed block's token ids, from its key's chunk (little-endian uint32 each)."""
    assert block.key is not None, "only an indexed block has its tokens in its key"
    chunk = block.key[1]
    return list(struct.unpack(f"<{len(chunk) // TOKEN_BYTES}I", chunk))
