"""The engine's side of a second KV tier: prefetch a prompt's blocks, load them, write new ones.

Read path: when a request arrives, the digests of its prompt blocks beyond the pool's hit
are fetched on the tier's threads while other requests keep stepping; the scheduler holds
the request back until the fetch is done or its deadline (a share of the time computing
those blocks would take) has passed, then loads what came back into newly allocated
blocks and commits them. Write path: after each forward, the full blocks it computed are
copied out of the KV store and queued to the tier's writer thread; a step never waits.
Retained blocks (``KVCacheManager.retention_ttl``) go with their seconds left, and the tier
keeps them at least that long.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

import torch

from prefixcache.cache import KVCacheManager
from prefixcache.cache.blocks import Block
from prefixcache.cache.events import BlockRemoved, BlockStored, EventSink
from prefixcache.engine.kv_store import KVStore
from prefixcache.engine.request import Branch, Request
from prefixcache.engine.scheduler import ScheduledChunk
from prefixcache.tier import BlockFormat, TierClient
from prefixcache.tier.client import Chain
from prefixcache.tier.seal import TierKeys

KV_LAYOUT = "layer,kv,token,kv_head,head_dim"
# int8: each row is head_dim int8 codes then their fp32 scale (absmax / 127), as bytes.
KV_LAYOUT_INT8 = "layer,kv,token,kv_head,int8[head_dim]+float32_scale"
DEFAULT_SECONDS_PER_TOKEN = 2e-3  # prefill cost before the engine has measured its own
DEADLINE_SHARE = 0.5  # wait at most this share of the compute the load would save


def block_format(manager: KVCacheManager, kv_store: KVStore) -> BlockFormat:
    """What every tier value of this engine must match (model namespace, KV dtype, layout):
    a value of another KV dtype never loads (its namespace differs too, so it is not even
    looked up: a miss)."""
    itemsize = kv_store.layers[0].element_size()
    dtype = str(kv_store.dtype).removeprefix("torch.")
    layout = KV_LAYOUT_INT8 if kv_store.dtype == torch.int8 else KV_LAYOUT
    return BlockFormat(manager.root_digest, dtype, layout, kv_store.block_shape, itemsize)


@dataclass(slots=True)
class PendingFetch:
    """A tier fetch of prompt blocks ``first``.. of one request, and when to stop waiting."""

    first: int
    future: Future
    deadline: float


class TierLink:
    """Moves KV blocks between the engine's pool and a ``TierClient``."""

    def __init__(
        self,
        client: TierClient,
        keys: TierKeys,
        manager: KVCacheManager,
        kv_store: KVStore,
        min_wait: float = 0.0,
        max_wait: float = 0.5,
    ) -> None:
        self.client = client
        self.keys = keys  # values are sealed per tenant salt (``tier.seal``)
        self.manager = manager
        self.kv_store = kv_store
        self.min_wait = min(min_wait, max_wait)  # seconds a request may always wait
        self.max_wait = max_wait  # seconds a request may wait for its blocks, at most
        self.seconds_per_token: float | None = None  # the engine's measured prefill speed
        self.timeouts = 0  # fetches given up at their deadline

    def prefetch(self, request: Request) -> None:
        """Start fetching the prompt blocks the pool does not hold (rule 10's cap applies)."""
        if not request.use_tier or not self.manager.enable_caching:
            return
        tokens, salt = request.prompt_token_ids, request.cache_salt
        digests = self.manager.prompt_digests(tokens, salt)
        first = self.manager.match(tokens, salt) // self.manager.block_size
        if first >= len(digests):
            return
        key = self.keys.current.for_salt(salt)
        future = self.client.start_fetch(
            digests[first:], key, depth0=first, fallback=self._previous(request, first)
        )
        wanted = (len(digests) - first) * self.manager.block_size
        rate = self.seconds_per_token or DEFAULT_SECONDS_PER_TOKEN
        wait = min(self.max_wait, max(self.min_wait, DEADLINE_SHARE * rate * wanted))
        request.tier_fetch = PendingFetch(first, future, time.perf_counter() + wait)

    def _previous(self, request: Request, first: int) -> Chain | None:
        """During a secret's rotation: the same blocks under the previous salt and key."""
        salt, previous = request.previous_cache_salt, self.keys.previous
        if salt is None or previous is None:
            return None
        digests = self.manager.prompt_digests(request.prompt_token_ids, salt)
        return Chain(digests[first:], previous.for_salt(salt))

    def ready(self, branch: Branch) -> bool:
        """Whether the branch may be admitted: no fetch pending, or it is done or too late."""
        fetch = branch.request.tier_fetch
        return fetch is None or fetch.future.done() or time.perf_counter() >= fetch.deadline

    def wait_for_fetches(self, branches: Iterable[Branch], timeout: float = 0.002) -> None:
        """Block briefly until one pending fetch finishes (instead of spinning the engine)."""
        pending = [b.request.tier_fetch.future for b in branches if b.request.tier_fetch]
        if pending:
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)

    def load(self, branch: Branch) -> int:
        """After admission: copy the fetched blocks into the branch's new blocks; how many."""
        request, seq = branch.request, branch.seq
        fetch, request.tier_fetch = request.tier_fetch, None
        if fetch is None or seq is None:
            return 0
        if not fetch.future.done():
            self.timeouts += 1
            fetch.future.cancel()
            return 0
        payloads = fetch.future.result()
        hit = seq.num_cached_tokens // self.manager.block_size
        usable = payloads[hit - fetch.first :] if hit >= fetch.first else []
        room = (seq.num_prompt_tokens - 1) // self.manager.block_size - hit
        usable = usable[: max(0, room)]
        if (hit + len(usable)) * self.manager.block_size < request.min_hit_tokens:
            usable = []  # a short hit is a miss, wherever it comes from
        for offset, payload in enumerate(usable):
            self.kv_store.write_block(seq.block_table[hit + offset], payload)
        if usable:
            self.manager.commit_loaded(seq, len(usable))
            request.num_tier_tokens += len(usable) * self.manager.block_size
        return len(usable)

    def write_computed(self, chunks: list[ScheduledChunk]) -> None:
        """Queue every full block this forward computed (of requests that use the tier), each
        with its retention's seconds left; a prompt's last chunk also extends the retention
        of its earlier blocks (hits and earlier chunks), which the tier may hold already."""
        block_size, ttl_of = self.manager.block_size, self.manager.retention_ttl
        ids, digests, depths, keys, ttls = [], [], [], [], []
        for chunk in chunks:
            seq, request = chunk.branch.seq, chunk.branch.request
            if seq is None or not request.use_tier:
                continue
            key = self.keys.current.for_salt(request.cache_salt)
            first = chunk.start // block_size
            end = min((chunk.start + chunk.num_tokens) // block_size, seq.num_stored_blocks)
            for index in range(first, end):
                block = seq.blocks[index]
                if block.key is not None:  # the indexed copy: its KV is now computed
                    ids.append(block.block_id)
                    digests.append(block.digest)
                    depths.append(index)
                    keys.append(key)
                    ttls.append(ttl_of(block))
            if request.retention and chunk.start + chunk.num_tokens == seq.num_prompt_tokens:
                self._retain_earlier(seq.blocks[: min(first, seq.num_stored_blocks)])
        if ids:
            copies = self.kv_store.read_blocks(ids)
            rows = zip(copies, digests, depths, keys, ttls, strict=True)
            for copy, digest, depth, key, ttl in rows:
                payload = copy.reshape(-1).view(torch.uint8).numpy()  # numpy has no bf16
                self.client.submit_write(digest, depth, payload.tobytes, key, ttl)

    def _retain_earlier(self, blocks: list[Block]) -> None:
        """Extend the tier's retention of blocks computed before this forward (no payload)."""
        for block in blocks:
            ttl = self.manager.retention_ttl(block)
            if ttl is not None and block.digest is not None:
                self.client.submit_retain(block.digest, ttl)

    def report_events(self, sink: EventSink) -> None:
        """Tell ``sink`` of blocks stored in (and evicted from) the tier, with its medium."""
        medium, block_size = self.client.medium, self.manager.block_size
        dtype = str(self.kv_store.dtype).removeprefix("torch.")

        def stored(digest: bytes) -> None:
            sink(BlockStored([digest], None, [], block_size, None, medium, dtype))

        def removed(digests: list[bytes]) -> None:
            sink(BlockRemoved(list(digests), medium))

        self.client.on_written = stored
        if hasattr(self.client.backend, "on_removed"):  # Redis evicts on its own, unseen
            self.client.backend.on_removed = removed

    def close(self) -> None:
        """Finish queued writes (briefly) and close the store."""
        self.client.close()
