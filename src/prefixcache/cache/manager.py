"""KVCacheManager: admission, commit, append, fork and free over one block pool."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from collections.abc import Sequence as SequenceOf
from typing import TYPE_CHECKING

from prefixcache.cache import integrity
from prefixcache.cache.block_pool import BlockPool
from prefixcache.cache.blocks import Block
from prefixcache.cache.common import DEFAULT_BLOCK_SIZE, TOKEN_BYTES, cdiv
from prefixcache.cache.events import (
    MEDIUM_POOL,
    AllBlocksCleared,
    BlockStored,
    RemovalReporter,
    WindowReporter,
)
from prefixcache.cache.groups import KVGroupSpec, window_sizes
from prefixcache.cache.hashing import (
    ROOT_UID,
    Extras,
    MultiModalItem,
    Namespace,
    block_digest,
    block_extras,
    chain_digests,
    encode_tokens,
    get_hash_function,
    group_digest,
    namespace_digest,
)
from prefixcache.cache.index import DEFAULT_INDEX, make_index
from prefixcache.cache.owners import Owners, OwnerUsage
from prefixcache.cache.path_memo import PathMemo
from prefixcache.cache.policies import DEFAULT_POLICY, make_policy
from prefixcache.cache.retention import DEFAULT_SHARE, Retention
from prefixcache.cache.sequence import ChainKeys, Sequence
from prefixcache.cache.stats import CacheStats
from prefixcache.cache.validation import (
    check_fits,
    check_mm_items,
    check_optional_str,
    check_prompt,
    check_retention,
    check_token_ids,
)
from prefixcache.cache.window_pages import WindowPages

if TYPE_CHECKING:
    from prefixcache.cache.events import EventSink
    from prefixcache.cache.observer import CacheObserver


class KVCacheManager:
    """Paged KV blocks with automatic prefix caching (the article's allocator).

    Capacity is checked before any side effect, and hits are touched before any
    allocation, so an admission that fails changes nothing and a request never evicts
    the prefix it has just found. With ``owner_shares`` (``{}``: equal shares) the pool is
    tenant-fair: see ``OwnerParts``; without it, owners are ignored and nothing changes.
    ``retain`` keeps a prefix past the eviction policy's order (``Retention``): each owner
    may retain ``retention_budget`` of the pool (``retention_budgets`` per owner name);
    ``clock`` is when marks expire (seconds; tests pass a fake one).
    ``groups`` (a hybrid model: a full group, then window groups) gives every block one page
    per window group as well, from the same pool; each window group keeps only what its
    window reads (``WindowPages``), and a hit is the longest prefix every group serves.
    """

    _event_sink: EventSink | None = None  # see set_event_sink
    _event_token_ids = False
    _event_kv_dtype: str | None = None
    removals: RemovalReporter | None = None  # while events are reported
    window_events: WindowReporter | None = None  # ... by a pool with window groups

    def __init__(
        self,
        num_blocks: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        *,
        enable_caching: bool = True,
        namespace: Namespace | None = None,
        hash_algo: str = "sha256",
        eviction_policy: str = DEFAULT_POLICY,
        index: str = DEFAULT_INDEX,
        owner_shares: Mapping[str, float] | None = None,
        clock: Callable[[], float] = time.monotonic,
        retention_budget: float = DEFAULT_SHARE,
        retention_budgets: Mapping[str, float] | None = None,
        groups: SequenceOf[KVGroupSpec] = (),
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1"
            )
        self.namespace = namespace or Namespace(block_size=block_size)
        if self.namespace.block_size != block_size:
            raise ValueError(
                f"namespace.block_size {self.namespace.block_size} != block_size {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_algo = hash_algo
        self._hash_fn = get_hash_function(hash_algo)
        self.root_digest = namespace_digest(self.namespace, self._hash_fn)
        self.stats = CacheStats(min_free_blocks=num_blocks)
        self.owners = None if owner_shares is None else Owners(owner_shares)  # None: not fair
        self.pool = BlockPool(
            num_blocks,
            self.stats,
            make_policy(eviction_policy, num_blocks),
            make_index(index, block_size),
            self.owners,
            Retention(num_blocks, self.stats, clock, retention_budget, retention_budgets),
        )
        self.eviction_policy, self.index = eviction_policy, index
        self.groups = tuple(groups)
        windows = window_sizes(self.groups)
        self.windows = (
            None
            if not windows
            else WindowPages(windows, block_size, self.stats, self.pool.empty_queue)
        )
        self.pool.windows = self.windows
        self.pages_per_block = 1 + len(windows)  # pool pages one block takes while held whole
        self._walk = self.pool.cached.walk  # rule 4: extend hits through the index
        self.sequences: dict[str, Sequence] = {}
        self._pending_copies: list[tuple[int, int]] = []
        self._memo = PathMemo()
        self.observer: CacheObserver | None = None

    def set_observer(self, observer: CacheObserver) -> None:
        """Report every admission, free and eviction to ``observer`` (debug logging)."""
        self.observer = observer
        self.pool.on_evict.append(observer.evicted)

    def set_event_sink(
        self,
        sink: EventSink | None,
        *,
        token_ids: bool = False,
        kv_cache_dtype: str | None = None,
    ) -> None:
        """Report KV events to ``sink`` (None: stop); token ids, prompt text, only if asked.

        ``BlockStored`` when content becomes matchable (with the pool's ``kv_cache_dtype``,
        if given), ``BlockRemoved`` when its last indexed copy leaves the pool,
        ``AllBlocksCleared`` on ``reset``. A window group's events (``group_idx`` g + 1)
        follow its pages of indexed blocks (``WindowReporter``).
        """
        self._event_sink = sink
        self._event_token_ids = token_ids
        self._event_kv_dtype = kv_cache_dtype
        if self.removals is not None:
            self.removals.detach()
        if self.window_events is not None:
            self.window_events.detach()
        self.removals = None if sink is None else RemovalReporter(self.pool, sink)
        self.window_events = (
            None
            if sink is None or self.windows is None
            else WindowReporter(
                self.pool,
                self.windows,
                sink,
                token_ids=token_ids,
                kv_cache_dtype=kv_cache_dtype,
            )
        )

    def record_reused_blocks(self) -> None:
        """From now on, remember every block id handed out (see ``pop_reused_blocks``)."""
        if self.pool.reused is None:
            self.pool.reused = []

    def pop_reused_blocks(self) -> list[int]:
        """Block ids allocated since the last call: slots whose old KV a new owner gets.

        Empty unless ``record_reused_blocks()`` was called. The engine zeroes those that
        held sensitive KV before anything is written into them.
        """
        reused = self.pool.reused
        if not reused:
            return []
        self.pool.reused = []
        return reused

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks with refcount 0, cached or not: what an allocation can take."""
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Share of blocks held by live requests."""
        return 1.0 - self.pool.num_free_blocks / self.num_blocks

    def owner_usage(self) -> list[OwnerUsage]:
        """Per owner: share, free cached blocks, evictions suffered and caused ([]: not fair)."""
        return self.pool.parts.usage()

    def retained_blocks(self) -> int:
        """Blocks retained now (marked, unexpired), held or free."""
        return self.pool.retention.retained_blocks()

    def retention_usage(self) -> dict[tuple[str | None, str], int]:
        """Blocks retained now, by (owner, retention class)."""
        return self.pool.retention.usage()

    def retention_ttl(self, block: Block) -> float | None:
        """Seconds left on ``block``'s retention mark; None if it is unmarked or expired."""
        retention = self.pool.retention
        left = retention.expiry[block.block_id] - retention.clock()
        return left if left > 0 else None

    def match(
        self,
        token_ids: SequenceOf[int],
        cache_salt: str | None = None,
        lora_name: str | None = None,
        mm_items: SequenceOf[MultiModalItem] = (),
        *,
        cap_last_token: bool = True,
        min_hit_tokens: int = 0,
    ) -> int:
        """Tokens ``admit`` would serve from cache right now; changes nothing."""
        hits = self._matched_blocks(
            token_ids, cache_salt, lora_name, mm_items, cap_last_token, min_hit_tokens
        )
        return len(hits) * self.block_size

    def matched_block_ids(
        self,
        token_ids: SequenceOf[int],
        cache_salt: str | None = None,
        *,
        min_hit_tokens: int = 0,
    ) -> list[int]:
        """The ids of the blocks ``admit`` would serve from cache right now; changes nothing."""
        hits = self._matched_blocks(token_ids, cache_salt, None, (), True, min_hit_tokens)
        return [block.block_id for block in hits]

    def _matched_blocks(
        self,
        token_ids: SequenceOf[int],
        cache_salt: str | None,
        lora_name: str | None,
        mm_items: SequenceOf[MultiModalItem],
        cap_last_token: bool,
        min_hit_tokens: int,
    ) -> list[Block]:
        """The cached blocks ``admit`` would reuse right now; changes nothing."""
        token_bytes, extras = self._prepare(token_ids, cache_salt, lora_name, mm_items)
        if not self.enable_caching:
            return []
        max_blocks = (len(token_ids) - cap_last_token) // self.block_size
        found = self._walk(token_bytes, max_blocks, extras).blocks
        if self.windows is not None:
            found = found[: self.windows.longest_hit(found)]
        return found if len(found) * self.block_size >= min_hit_tokens else []

    def would_crowd_out(
        self,
        token_ids: SequenceOf[int],
        cache_salt: str | None = None,
        *,
        min_hit_tokens: int = 0,
        owner: str | None = None,
    ) -> bool:
        """Whether admitting this prompt for ``owner`` now would evict another owner's free
        cached blocks while that owner is within its share of the pool, or another owner's
        retained block (fair pools only). Expired retained blocks are swept back into their
        owners' policies first, as the allocation would (no content moves)."""
        owner_id = None if self.owners is None else self.owners.ids.get(owner)
        if owner_id is None:
            return False
        hits = self._matched_blocks(token_ids, cache_salt, None, (), True, min_hit_tokens)
        pool = self.pool
        new_pages = (cdiv(len(token_ids), self.block_size) - len(hits)) * self.pages_per_block
        evictions = new_pages - pool.empty_queue.size
        if self.windows is not None:  # stale pages go first, less those the hit takes
            evictions -= self.windows.spare_stale(self.windows.hit_rows(hits))
        if not pool.retention.free:
            return pool.parts.would_evict_protected(owner_id, evictions, hits)
        pool.sweep_expired()  # what the allocation would do first (moves no content)
        retained = {block.block_id for block in hits} & pool.retention.free.keys()
        unretained = [block for block in hits if block.block_id not in retained]
        last_resort = pool.retention.last_resort(retained)
        return pool.parts.would_evict_protected(owner_id, evictions, unretained, last_resort)

    def prompt_digests(
        self,
        token_ids: SequenceOf[int],
        cache_salt: str | None = None,
        lora_name: str | None = None,
        mm_items: SequenceOf[MultiModalItem] = (),
        *,
        cap_last_token: bool = True,
    ) -> list[bytes]:
        """Portable digests of the prompt's reusable full blocks (rule 10's cap unless lifted).

        What a second tier is asked for: the same chain every process computes.
        """
        token_bytes, extras = self._prepare(token_ids, cache_salt, lora_name, mm_items)
        num_blocks = (len(token_ids) - cap_last_token) // self.block_size
        step = self.block_size * TOKEN_BYTES
        blocks = (
            (token_bytes[index * step : (index + 1) * step], extras.get(index, ()))
            for index in range(num_blocks)
        )
        return chain_digests(self.root_digest, blocks, self._hash_fn)

    def group_digests(self, digests: SequenceOf[bytes], group: int) -> list[bytes]:
        """The identities of these blocks' pages in KV cache group ``group`` (0: the full
        layers, the digests themselves; 1..: window groups): a tier's keys for them."""
        return [group_digest(digest, group, self._hash_fn) for digest in digests]

    # -------------------------------------------------------------- lifecycle
    def admit(
        self,
        request_id: str,
        token_ids: SequenceOf[int],
        cache_salt: str | None = None,
        lora_name: str | None = None,
        mm_items: SequenceOf[MultiModalItem] = (),
        *,
        cap_last_token: bool = True,
        min_hit_tokens: int = 0,
        owner: str | None = None,
    ) -> Sequence | None:
        """Allocate a request's blocks, reusing its cached prefix; None if it cannot fit.

        Raises CapacityError when the prompt needs more blocks than the whole pool.
        ``cap_last_token=False`` lifts rule 10 (trace replay: no logits are needed).
        A hit shorter than ``min_hit_tokens`` is treated as a miss and recomputed, so a
        prompt cannot be probed for reuse a block at a time. ``owner`` (a tenant) is who
        its blocks are charged to once freed, in a fair pool.
        """
        if request_id in self.sequences:
            raise ValueError(f"request_id {request_id!r} is already admitted")
        check_optional_str("owner", owner)
        token_bytes, extras = self._prepare(token_ids, cache_salt, lora_name, mm_items)
        num_tokens = len(token_ids)
        check_fits(num_tokens, self.block_size, self.num_blocks, pages=self.pages_per_block)
        num_needed = cdiv(num_tokens, self.block_size)
        hits = self._lookup(token_bytes, num_tokens - cap_last_token, extras)
        hits, rows = self._window_hit(hits)
        if len(hits) * self.block_size < min_hit_tokens:
            hits, rows = [], [[] for _ in rows]
        hit_pages = [page for row in rows for page in row if page is not None]
        num_new = num_needed - len(hits)
        if not self._can_allocate(num_new * self.pages_per_block, hits + hit_pages):
            self.stats.failed_admissions += 1
            return None
        owner_id = 0 if self.owners is None else self.owners.id_of(owner)
        self.pool.touch(hits)  # before allocate: never evict the prefix just found
        if self.windows is not None:
            self.windows.acquire(hit_pages)  # nor the windows it reads (rule 5)
        blocks = hits + self.pool.allocate(num_new, owner_id)
        keys = ChainKeys(
            token_bytes,
            extras,
            self._hash_fn,
            self.root_digest,
            cache_salt,
            lora_name,
            tuple(mm_items),
            cap_last_token,
        )
        if self.windows is not None:
            pages = self.pool.allocate(num_new * len(rows), owner_id)
            self.windows.extend(rows, blocks[len(hits) :], pages)
        seq = Sequence(
            request_id, self.block_size, list(token_ids), blocks, keys, len(hits), owner_id, rows
        )
        self.sequences[request_id] = seq
        self._count_admission(num_tokens, seq.num_cached_tokens)
        if self.observer is not None:
            self.observer.admitted(seq, len(hits))
        return seq

    def commit(self, seq: Sequence, num_tokens: int, reading_from: int | None = None) -> None:
        """KV of tokens [0, num_tokens) is computed: its full blocks become matchable.

        Window pages no query from ``reading_from`` on reads are given back (default: from
        ``num_tokens``; an engine committing a chunk as it schedules it passes its start)."""
        if self.sequences.get(seq.request_id) is not seq:
            self._check_live(seq)
        if not 0 <= num_tokens <= len(seq.token_ids):
            raise ValueError(f"commit of {num_tokens} tokens; the sequence has {seq.num_tokens}")
        if num_tokens > seq.num_computed_tokens:
            seq.num_computed_tokens = num_tokens
        full = seq.num_computed_tokens // self.block_size
        if full > seq.num_stored_blocks and self.enable_caching:
            if self._event_sink is None:
                for index in range(seq.num_stored_blocks, full):
                    self._store_block(seq, index)
            else:
                self._store_reported(seq, seq.num_stored_blocks, full)
            seq.num_stored_blocks = full
        if self.windows is not None:
            self.windows.slide(
                seq, seq.num_computed_tokens if reading_from is None else reading_from
            )

    def commit_loaded(self, seq: Sequence, num_blocks: int) -> None:
        """The next ``num_blocks`` blocks after the hit were loaded from a second tier.

        They count as cached (served without compute) and become matchable at once. They
        must be the sequence's own (not shared by a fork, not stored by a sharer). With
        window groups, each group's pages of the window before the loaded end must have been
        loaded too (``WindowPages.loaded_from``); its earlier new pages go back empty.
        """
        self._check_live(seq)
        start = seq.num_cached_tokens
        end = start + num_blocks * self.block_size
        if seq.num_computed_tokens != start or end > seq.num_prompt_tokens - seq.cap_last_token:
            raise ValueError(
                f"cannot load {num_blocks} blocks into {seq.request_id!r}: "
                f"{seq.num_computed_tokens} tokens computed, {start} cached (rule 10)"
            )
        loaded = seq.blocks[start // self.block_size : end // self.block_size]
        if any(block.ref_cnt > 1 or block.uid for block in loaded):
            raise ValueError(f"cannot load into {seq.request_id!r}: its blocks are shared")
        if self.windows is not None:  # loaded: each window group's window before ``end``
            self.windows.drop_unloaded(seq, start // self.block_size, end // self.block_size)
        seq.num_cached_tokens = end
        self.stats.tier_hits += end - start
        self.commit(seq, end)

    def append(self, seq: Sequence, token_ids: SequenceOf[int]) -> bool:
        """Add generated tokens; False (and nothing changed) when out of blocks.

        A shared partial last block (after ``fork``) is copied first; the engine must
        apply ``pop_pending_copies()`` before writing KV into it.
        """
        if self.sequences.get(seq.request_id) is not seq:
            self._check_live(seq)
        check_token_ids(token_ids)
        tokens = seq.token_ids
        room = len(seq.blocks) * self.block_size - len(tokens)
        # The common decode step: the tokens fit in a private, partly filled last block.
        if len(token_ids) > room or (room and seq.blocks[-1].ref_cnt > 1):
            num_new = cdiv(len(tokens) + len(token_ids), self.block_size) - len(seq.blocks)
            if not self._grow(seq, num_new):
                return False
        tokens.extend(token_ids)
        return True

    def _grow(self, seq: Sequence, num_new: int) -> bool:
        """Give ``seq`` its new blocks and a private copy of a shared partial tail."""
        copy_on_write = seq.num_tokens % self.block_size != 0 and seq.blocks[-1].ref_cnt > 1
        if (num_new + copy_on_write) * self.pages_per_block > self.pool.num_free_blocks:
            return False
        if copy_on_write:
            self._copy_last_block(seq)
        new_blocks = self.pool.allocate(num_new, seq.owner)
        seq.blocks.extend(new_blocks)
        seq.block_table.extend(block.block_id for block in new_blocks)
        if self.windows is not None:
            pages = self.pool.allocate(num_new * self.windows.num_groups, seq.owner)
            self.windows.extend(seq.window_pages, new_blocks, pages, seq.window_tables)
        return True

    def retain(
        self,
        seq: Sequence,
        num_tokens: int,
        ttl_seconds: float,
        retention_class: str = "5m",
        owner: str | None = None,
    ) -> int:
        """Keep the stored full blocks of ``seq`` covering tokens [0, num_tokens) cached for
        ``ttl_seconds`` more (an expiry is only ever extended); how many blocks are retained.

        Retained free blocks are evicted only when nothing else is free, so a retention never
        makes an admission fail. Marks past ``owner``'s budget are refused and counted
        (``stats.retention_refused``), never an error.
        """
        self._check_live(seq)
        check_retention(num_tokens, ttl_seconds, retention_class)
        check_optional_str("owner", owner)
        count = min(num_tokens // self.block_size, seq.num_stored_blocks)
        return self.pool.retention.mark(seq.blocks[:count], ttl_seconds, retention_class, owner)

    def fork(self, seq: Sequence, request_id: str) -> Sequence:
        """A new request sharing every block of ``seq`` (copy-on-write for the tail)."""
        self._check_live(seq)
        if request_id in self.sequences:
            raise ValueError(f"request_id {request_id!r} is already admitted")
        child = seq.clone(request_id)
        self.pool.touch(child.blocks)
        if self.windows is not None:
            self.windows.acquire([p for row in child.window_pages for p in row if p is not None])
        self.sequences[request_id] = child
        return child

    def free(self, seq: Sequence) -> None:
        """Release every block, deepest first, so shared shallow prefixes live longest."""
        self._check_live(seq)
        if self.observer is not None:
            self.observer.freed(seq)
        if self.windows is not None:  # first: a page's fate depends on its block's identity
            self.windows.release_all(seq)
        self.pool.release(reversed(seq.blocks), seq.owner)
        del self.sequences[seq.request_id]
        seq.blocks = []
        seq.block_table = []

    def reset(self) -> bool:
        """Drop every cached block; False (nothing dropped) while any block is in use."""
        if self.pool.num_free_blocks != self.num_blocks:
            return False
        self.pool.drop_all_cached()
        self._memo.clear()
        self.stats.resets += 1
        if self._event_sink is not None:
            self._event_sink(AllBlocksCleared())
        return True

    def pop_pending_copies(self) -> list[tuple[int, int]]:
        """(source, destination) block ids whose KV the engine must copy, oldest first."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def check_invariants(self) -> None:
        """AssertionError naming the first violated invariant (rules 5-8 of docs/design.md)."""
        integrity.check(self)

    # ---------------------------------------------------------------- helpers
    def _prepare(
        self,
        token_ids: SequenceOf[int],
        cache_salt: str | None,
        lora_name: str | None,
        mm_items: SequenceOf[MultiModalItem],
    ) -> tuple[bytes, dict[int, Extras]]:
        """Validate a request; return its token bytes and per-block extra keys."""
        check_prompt(token_ids)
        check_optional_str("cache_salt", cache_salt)
        check_optional_str("lora_name", lora_name)
        check_mm_items(mm_items, len(token_ids))
        token_bytes = encode_tokens(token_ids)
        special = {0} | {
            index
            for item in mm_items
            for index in range(
                item.offset // self.block_size,
                cdiv(item.offset + item.length, self.block_size),
            )
        }
        extras = {}
        for index in special:
            found = block_extras(index, self.block_size, cache_salt, lora_name, mm_items)
            if found:
                extras[index] = found
        return token_bytes, extras

    def _lookup(self, token_bytes: bytes, num_matchable: int, extras: dict) -> list[Block]:
        """Cached blocks for an admission: the remembered path, then the index walk.

        ``num_matchable`` is the prompt length less rule 10's last token (unless lifted).
        """
        if not self.enable_caching:
            return []
        step = self.block_size * TOKEN_BYTES
        max_blocks = num_matchable // self.block_size
        memo_key = tuple(extras.items()) if extras else None
        hits, uids = self._memo.recall(memo_key, token_bytes, max_blocks, step)
        recalled = len(hits)
        if recalled < max_blocks:
            parent = uids[-1] if recalled else ROOT_UID
            found = self._walk(token_bytes, max_blocks, extras, recalled, parent)
            if found.blocks:  # the walk learned something the memo did not know
                hits += found.blocks
                uids += found.uids
                self._memo.remember(memo_key, token_bytes, hits, uids, step)
        return hits

    def _window_hit(self, hits: list[Block]) -> tuple[list[Block], list[list[Block | None]]]:
        """The hit every group serves, and each window group's pages of it (none: [])."""
        windows = self.windows
        if windows is None:
            return hits, []
        usable = windows.longest_hit(hits)
        self.stats.window_lost_tokens += (len(hits) - usable) * self.block_size
        return hits[:usable], windows.hit_rows(hits[:usable])

    def _can_allocate(self, num_new: int, hits: list[Block]) -> bool:
        """Whether ``num_new`` blocks fit once the hits leave the free queue."""
        free = self.pool.num_free_blocks
        if num_new <= free - len(hits):  # true even if every hit sits in the queue
            return True
        return num_new <= free - sum(1 for block in hits if block.ref_cnt == 0)

    def _store_block(self, seq: Sequence, index: int) -> bool:
        """Make full block ``index`` of ``seq`` matchable (lazily digesting it once).

        True if it became the indexed copy (not a duplicate, not stored by a sharer).
        """
        block = seq.blocks[index]
        if not block.uid:  # a sharer (fork) may already have stored it
            chunk = seq.block_bytes(index)
            extra = seq.extras.get(index)
            parent = seq.blocks[index - 1].uid if index else ROOT_UID
            key = (parent, chunk, extra) if extra else (parent, chunk)
            digest = block_digest(seq.parent_digest(index), chunk, extra or (), self._hash_fn)
            self.pool.store(block, key, digest)
            if block.key is None and self.windows is not None:
                self.windows.adopt(self.pool.cached[key], block)
            return block.key is not None
        return False

    def _store_reported(self, seq: Sequence, start: int, end: int) -> None:
        """Store blocks [start, end); one ``BlockStored`` per run of newly indexed ones."""
        first = start
        for index in range(start, end):
            if not self._store_block(seq, index):
                if first < index:
                    self._announce(seq, first, index)
                first = index + 1
        if first < end:
            self._announce(seq, first, end)

    def _announce(self, seq: Sequence, first: int, end: int) -> None:
        """Send ``BlockStored`` for blocks [first, end) of ``seq``, a chain below block first-1."""
        blocks, size = seq.blocks, self.block_size
        event = BlockStored(
            block_hashes=[block.digest for block in blocks[first:end]],
            parent_block_hash=blocks[first - 1].digest if first else None,
            token_ids=seq.token_ids[first * size : end * size] if self._event_token_ids else [],
            block_size=size,
            lora_id=None,
            medium=MEDIUM_POOL,
            kv_cache_dtype=self._event_kv_dtype,
        )
        self._event_sink(event)
        if self.window_events is not None:
            self._announce_windows(seq, first, end)

    def _announce_windows(self, seq: Sequence, first: int, end: int) -> None:
        """Per window group, one ``BlockStored`` per run of blocks [first, end) of ``seq``
        with a page in it (each hanging from the block before it, as in group 0)."""
        windows, reporter, size = self.windows, self.window_events, self.block_size
        assert windows is not None and reporter is not None
        blocks, tokens = seq.blocks, seq.token_ids if self._event_token_ids else None
        for group in range(windows.num_groups):
            start = first
            for index in range(first, end + 1):
                if index < end and windows.page(blocks[index], group) is not None:
                    continue
                if start < index:
                    reporter.announce(
                        group,
                        [block.digest for block in blocks[start:index]],
                        blocks[start - 1].digest if start else None,
                        [] if tokens is None else tokens[start * size : index * size],
                    )
                start = index + 1

    def _copy_last_block(self, seq: Sequence) -> None:
        """Copy-on-write: give ``seq`` a private copy of its shared partial last block."""
        (copy,) = self.pool.allocate(1, seq.owner)
        shared = seq.blocks[-1]
        if self.windows is not None:
            pages = self.pool.allocate(self.windows.num_groups, seq.owner)
            self._pending_copies += self.windows.replace_last(seq, copy, pages)
        self.pool.release([shared], seq.owner)
        seq.blocks[-1] = copy
        seq.block_table[-1] = copy.block_id
        self._pending_copies.append((shared.block_id, copy.block_id))
        self.stats.cow_copies += 1

    def _check_live(self, seq: Sequence) -> None:
        """ValueError unless ``seq`` is a live sequence of this manager."""
        if self.sequences.get(seq.request_id) is not seq:
            raise ValueError(f"sequence {seq.request_id!r} is not live in this manager")

    def _count_admission(self, num_tokens: int, num_cached: int) -> None:
        self.stats.requests += 1
        self.stats.queries += num_tokens
        self.stats.hits += num_cached
