"""The engine's side of a second KV tier: prefetch a prompt's blocks, load them, write new ones.

Read path: when a request arrives, the digests of its prompt blocks beyond the pool's hit
are fetched on the tier's threads while other requests keep stepping; the scheduler holds
the request back until the fetch is done or its deadline (a share of the time computing
those blocks would take) has passed, then loads what came back into newly allocated
blocks and commits them. A hybrid pool's window groups store each page as its own value
(under ``KVCacheManager.group_digests``): a load takes the full layers' values of every
block and each window group's values of the window before the load's end only.

Write path: after each forward, the full blocks it computed are copied out of the KV
store (each of their pages) and queued to the tier's writer thread; a step never waits.
Retained blocks (``KVCacheManager.retention_ttl``) go with their seconds left, and the tier
keeps them at least that long.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import NamedTuple

import torch

from prefixcache.cache import KVCacheManager
from prefixcache.cache.blocks import Block
from prefixcache.cache.events import BlockRemoved, BlockStored, EventSink
from prefixcache.cache.sequence import Sequence
from prefixcache.engine.kv_store import KVStore
from prefixcache.engine.request import Branch, Request
from prefixcache.engine.scheduler import ScheduledChunk
from prefixcache.tier import BlockFormat, TierClient
from prefixcache.tier.client import Chain
from prefixcache.tier.seal import SealKey, TierKeys

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
    future: Future[Fetched]
    deadline: float


@dataclass(slots=True)
class Fetched:
    """What a fetch found: the full layers' values of blocks [first, end) and, per window
    group, its values of blocks from ``starts[g]`` to ``end`` (the window before ``end``)."""

    first: int
    full: list[memoryview]
    starts: list[int]
    windows: list[list[memoryview]]

    @property
    def end(self) -> int:
        return self.first + len(self.full)


NOTHING = Fetched(0, [], [], [])


class ValueWrite(NamedTuple):
    """One page to store: its pool page, the value's digest, chain depth, seal and retention."""

    page: int
    digest: bytes
    depth: int
    key: SealKey
    ttl: float | None
    group: int  # 0: the full layers; KV events name those values only


def usable_end(fetched: Fetched, loaded_from: Callable[[int, int], int]) -> int:
    """The furthest end E <= ``fetched.end`` at which every window group holds the window
    before E (from ``loaded_from(group, E)``, or from ``first``); ``first`` if none."""
    first, end = fetched.first, fetched.end
    for start, values in zip(fetched.starts, fetched.windows, strict=True):
        if start + len(values) < fetched.end:  # a value missing: only a run from first helps
            end = min(end, start + len(values) if start == first else first)
    for group, (start, values) in enumerate(zip(fetched.starts, fetched.windows, strict=True)):
        if start > max(first, loaded_from(group, end)) or start + len(values) < end:
            return first
    return end


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
        chain = Chain(digests, self.keys.current.for_salt(salt))
        future = self.client.start(self._fetch, NOTHING, chain, self._previous(request), first)
        wanted = (len(digests) - first) * self.manager.block_size
        rate = self.seconds_per_token or DEFAULT_SECONDS_PER_TOKEN
        wait = min(self.max_wait, max(self.min_wait, DEADLINE_SHARE * rate * wanted))
        request.tier_fetch = PendingFetch(first, future, time.perf_counter() + wait)

    def _previous(self, request: Request) -> Chain | None:
        """During a secret's rotation: the same blocks under the previous salt and key."""
        salt, previous = request.previous_cache_salt, self.keys.previous
        if salt is None or previous is None:
            return None
        digests = self.manager.prompt_digests(request.prompt_token_ids, salt)
        return Chain(digests, previous.for_salt(salt))

    def _fetch(self, chain: Chain, previous: Chain | None, first: int) -> Fetched:
        """On a tier thread: the full layers' values of blocks ``first``.. and then each
        window group's values of the window before where they end; cut to the longest end
        every group can serve (rule 11 for a load)."""
        full = self._fetch_group(chain, previous, 0, first, len(chain.digests))
        fetched = Fetched(first, full, [], [])
        windows = self.manager.windows
        if windows is None or not full:
            return fetched
        for group in range(windows.num_groups):
            start = max(first, windows.loaded_from(group, fetched.end))
            fetched.starts.append(start)
            fetched.windows.append(
                self._fetch_group(chain, previous, group + 1, start, fetched.end)
            )
        del full[usable_end(fetched, windows.loaded_from) - first :]
        return fetched

    def _fetch_group(
        self, chain: Chain, previous: Chain | None, group: int, start: int, end: int
    ) -> list[memoryview]:
        """The leading run of group ``group``'s values of blocks [start, end)."""
        keys = self.manager.group_digests(chain.digests[start:end], group)
        fallback = None
        if previous is not None:
            fallback = Chain(self.manager.group_digests(previous.digests[start:end], group),
                             previous.key)  # fmt: skip
        return self.client.fetch(keys, chain.key, depth0=start, fallback=fallback)

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
        fetched, block_size = fetch.future.result(), self.manager.block_size
        hit, end = seq.num_cached_tokens // block_size, fetched.end
        cap = (seq.num_prompt_tokens - 1) // block_size  # rule 10: as the digests were
        if not fetched.first <= hit < end <= cap or end * block_size < request.min_hit_tokens:
            return 0  # nothing past the pool's hit, or a short hit: a miss either way
        for index in range(hit, end):
            self.kv_store.write_block(seq.block_table[index], fetched.full[index - fetched.first])
        self._load_windows(fetched, seq, hit)
        self.manager.commit_loaded(seq, end - hit)
        request.num_tier_tokens += (end - hit) * block_size
        return end - hit

    def _load_windows(self, fetched: Fetched, seq: Sequence, hit: int) -> None:
        """Each window group's pages of the window before the loaded end (from the hit on:
        before it the pool's own pages serve)."""
        windows, end = self.manager.windows, fetched.end
        for group, (start, values) in enumerate(zip(fetched.starts, fetched.windows, strict=True)):
            assert windows is not None
            table = seq.window_tables[group]
            for index in range(max(hit, windows.loaded_from(group, end)), end):
                self.kv_store.write_block(table[index], values[index - start])

    def write_computed(self, chunks: list[ScheduledChunk]) -> None:
        """Queue every full block this forward computed (of requests that use the tier), each
        with its retention's seconds left; a prompt's last chunk also extends the retention
        of its earlier blocks (hits and earlier chunks), which the tier may hold already."""
        block_size = self.manager.block_size
        writes: list[list[ValueWrite]] = [[] for _ in range(self.manager.pages_per_block)]
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
                    self._queue_pages(block, index, key, writes)
            if request.retention and chunk.start + chunk.num_tokens == seq.num_prompt_tokens:
                self._retain_earlier(seq.blocks[: min(first, seq.num_stored_blocks)])
        self._submit([write for group in writes for write in group])  # full layers first

    def _queue_pages(
        self, block: Block, depth: int, key: SealKey, writes: list[list[ValueWrite]]
    ) -> None:
        """A computed block's pages, a value each: the full layers' under its digest, each
        window group's (while attached) under its group digest (``group_digests``)."""
        ttl = self.manager.retention_ttl(block)
        assert block.digest is not None
        writes[0].append(ValueWrite(block.block_id, block.digest, depth, key, ttl, 0))
        windows = self.manager.windows
        for group in range(windows.num_groups if windows is not None else 0):
            page = windows.page(block, group)
            if page is not None:
                (digest,) = self.manager.group_digests([block.digest], group + 1)
                write = ValueWrite(page.block_id, digest, depth, key, ttl, group + 1)
                writes[group + 1].append(write)

    def _submit(self, writes: list[ValueWrite]) -> None:
        """Copy the pages out now (the pool may reuse them) and queue them to the writer."""
        if not writes:
            return
        copies = self.kv_store.read_blocks([write.page for write in writes])
        for copy, write in zip(copies, writes, strict=True):
            payload = copy.reshape(-1).view(torch.uint8).numpy()  # numpy has no bf16
            self.client.submit_write(write.digest, write.depth, payload.tobytes, write.key,
                                     write.ttl, announce=write.group == 0)  # fmt: skip

    def _retain_earlier(self, blocks: list[Block]) -> None:
        """Extend the tier's retention of blocks computed before this forward (no payload)."""
        for block in blocks:
            ttl = self.manager.retention_ttl(block)
            if ttl is not None and block.digest is not None:
                self.client.submit_retain(block.digest, ttl)

    def report_events(self, sink: EventSink) -> None:
        """Tell ``sink`` of blocks stored in (and evicted from) the tier, with its medium: the
        full layers' values (group 0). A window group's value is never announced; its
        eviction from a disk tier reads as the removal of a digest no event stored, as does
        any value stored before this process (consumers ignore both)."""
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
