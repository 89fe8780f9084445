"""Random admit/commit/append/fork/free/reset on tiny pools, checked against shadow memory.

Every commit writes the sequence's token ids into ``shadow[(block id, slot)]``, as an
engine writes K/V. After every step each live sequence must read back exactly its own
computed tokens through its block table: a block evicted while in use, a stale mapping,
a shared block written without copy-on-write, all show up as another request's tokens.
The machine also subscribes to the KV events: the (digest, group) pairs they add and remove
must always be exactly what the pool can match, its indexed blocks (group 0) and, in a
hybrid pool, each window group's pages attached to them. Requests belong to owners; the ``Fair``
variants give the pool owner shares, and ``check_invariants`` then also proves the
per-owner counts add up to the pool. Owners also retain prefixes for a few seconds of a fake
clock that the machine advances, so retained blocks are held, freed, hit, expired, swept and
evicted as a last resort in every variant. The ``Hybrid`` variants give the pool window
groups: every write also lands in the pages of each window group, and each live sequence
must read its own tokens back through its window tables wherever its windows read; a
second tier's load writes only the window before its end, and the pages it left unwritten
must never be read.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    precondition,
    rule,
)

from conftest import pool_holdings
from prefixcache import CapacityError, KVCacheManager
from prefixcache.cache.common import cdiv
from prefixcache.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from prefixcache.cache.groups import KVGroupSpec

BASES = [
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
    [1, 2, 3, 4, 5, 6, 70, 80],
    [1, 2, 3, 4],
    [40, 41, 42, 43, 44, 45, 46, 47, 48],
    [],
]
TAILS = st.lists(st.integers(0, 3), max_size=9)
SALTS = st.sampled_from([None, "tenant-a", "tenant-b"])
OWNERS = st.sampled_from([None, "a", "b", "c"])  # owners may share a salt (and its blocks)
TTLS = st.sampled_from([1.0, 5.0, 30.0])  # seconds of the machine's clock


class CacheMachine(RuleBasedStateMachine):
    """A model engine driving the real manager; the shadow dict is its KV memory."""

    block_size = 4
    num_blocks = 8
    hash_algo = "sha256"
    eviction_policy = "lru"
    index = "hash"
    owner_shares: dict[str, float] | None = None  # None: owners are ignored (not fair)
    groups: tuple[KVGroupSpec, ...] = ()  # window groups after the full one: a hybrid pool
    sequences = Bundle("sequences")

    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(
            self.num_blocks,
            self.block_size,
            hash_algo=self.hash_algo,
            eviction_policy=self.eviction_policy,
            index=self.index,
            owner_shares=self.owner_shares,
            clock=self._clock,
            retention_budgets={"c": 1.0},  # the others keep the default half of the pool
            groups=self.groups,
        )
        self.shadow: dict[tuple[int, int], int] = {}
        self.next_id = 0
        self.event_held: set[tuple[bytes, int]] = set()  # (digest, group) a subscriber knows
        self.manager.set_event_sink(self._on_event)

    now = 0.0

    def _clock(self) -> float:
        return self.now

    def _on_event(self, event: KVEvent) -> None:
        if isinstance(event, BlockStored):
            self.event_held.update((digest, event.group_idx) for digest in event.block_hashes)
        elif isinstance(event, BlockRemoved):
            self.event_held.difference_update((d, event.group_idx) for d in event.block_hashes)
        else:
            assert isinstance(event, AllBlocksCleared)
            self.event_held.clear()

    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def _slot(self, seq, position: int) -> tuple[int, int]:
        return seq.block_table[position // self.block_size], position % self.block_size

    def _write(self, seq, position: int) -> None:
        """The engine writes a token's K/V in every group: the full table and each window's."""
        block, slot = divmod(position, self.block_size)
        self.shadow[(seq.block_table[block], slot)] = seq.token_ids[position]
        for table in seq.window_tables:
            assert table[block] >= 0, f"{seq.request_id} computes block {block} without a page"
            self.shadow[(table[block], slot)] = seq.token_ids[position]

    def _pages(self, tokens) -> int:
        """Pool pages a prompt of ``tokens`` takes while it computes."""
        return cdiv(len(tokens), self.block_size) * self.manager.pages_per_block

    @rule(target=sequences, base=st.sampled_from(BASES), tail=TAILS, salt=SALTS, owner=OWNERS)
    def admit(self, base, tail, salt, owner):
        tokens = base + tail or [0]
        free_before = self.manager.num_free_blocks
        expected_hit = self.manager.match(tokens, cache_salt=salt)
        protected = self._protected_owners(tokens, salt, owner)
        last_resorts = self.manager.stats.retention_evictions
        try:
            seq = self.manager.admit(self._new_id(), tokens, cache_salt=salt, owner=owner)
        except CapacityError:
            assert self._pages(tokens) > self.num_blocks
            return multiple()  # nothing to add
        if seq is None:
            assert self.manager.num_free_blocks == free_before
            # retained free blocks count as free: only a pool short of blocks refuses
            assert self._pages(tokens) > free_before
            return multiple()
        for name, suffered in protected.items():  # the fair admission check held its word
            assert self._usage()[name].evictions_suffered == suffered, name
        assert seq.num_cached_tokens == expected_hit
        assert seq.num_cached_tokens <= len(tokens) - 1
        self._check_last_resort(last_resorts)
        return seq

    def _check_last_resort(self, before: int) -> None:
        """Retained blocks were evicted only once nothing else was free."""
        if self.manager.stats.retention_evictions > before:
            pool = self.manager.pool
            assert pool.empty_queue.size == 0 and len(pool.parts) == 0
            assert pool.windows is None or len(pool.windows) == 0

    def _usage(self) -> dict:
        return {usage.name: usage for usage in self.manager.owner_usage()}

    def _protected_owners(self, tokens, salt, owner) -> dict:
        """Owners within their share whose evictions admitting ``tokens`` must not add to,
        when the fair admission check says it would not crowd them out: name -> suffered."""
        manager = self.manager
        if manager.owners is None or owner not in manager.owners.ids:
            return {}
        if manager.would_crowd_out(tokens, salt, owner=owner):
            return {}
        share = dict(zip(manager.owners.names, manager.owners.shares, strict=True))
        return {
            name: usage.evictions_suffered
            for name, usage in self._usage().items()
            if name != owner and usage.cached_blocks <= share[name] * manager.num_blocks
        }

    @rule(seq=sequences, data=st.data())
    def commit(self, seq, data):
        if seq.request_id not in self.manager.sequences:
            return
        upto = data.draw(st.integers(seq.num_computed_tokens, seq.num_tokens))
        for position in range(seq.num_computed_tokens, upto):
            self._write(seq, position)
        self.manager.commit(seq, upto)

    @rule(seq=sequences, data=st.data())
    def load(self, seq, data):
        """A second tier loads blocks after the hit (``TierLink.load``): every group's KV of
        each for the full table, each window group's only from its window before the end."""
        manager, size = self.manager, self.block_size
        start = seq.num_cached_tokens // size
        room = (seq.num_prompt_tokens - 1) // size - start  # rule 10's cap
        live = seq.request_id in manager.sequences
        if not live or seq.num_computed_tokens != seq.num_cached_tokens or room <= 0:
            return
        end = start + data.draw(st.integers(1, room))
        if any(block.ref_cnt > 1 or block.uid for block in seq.blocks[start:end]):
            with pytest.raises(ValueError, match="shared"):  # a fork's: never written twice
                manager.commit_loaded(seq, end - start)
            return
        for position in range(start * size, end * size):
            block, slot = divmod(position, size)
            self.shadow[(seq.block_table[block], slot)] = seq.token_ids[position]
        for group, table in enumerate(seq.window_tables):
            first = max(start, manager.windows.loaded_from(group, end))
            for position in range(first * size, end * size):
                block, slot = divmod(position, size)
                self.shadow[(table[block], slot)] = seq.token_ids[position]
        manager.commit_loaded(seq, end - start)
        assert seq.num_cached_tokens == seq.num_computed_tokens == end * size

    @rule(seq=sequences, tokens=st.lists(st.integers(0, 3), min_size=1, max_size=6))
    def append(self, seq, tokens):
        if seq.request_id not in self.manager.sequences:
            return
        before = (list(seq.block_table), seq.num_tokens, self.manager.num_free_blocks)
        last_resorts = self.manager.stats.retention_evictions
        if not self.manager.append(seq, tokens):
            assert (seq.block_table, seq.num_tokens, self.manager.num_free_blocks) == before
            return
        self._check_last_resort(last_resorts)
        for source, destination in self.manager.pop_pending_copies():
            for slot in range(self.block_size):
                if (source, slot) in self.shadow:
                    self.shadow[(destination, slot)] = self.shadow[(source, slot)]

    @rule(
        seq=sequences,
        num_blocks=st.integers(0, 5),
        ttl=TTLS,
        retention_class=st.sampled_from(["5m", "1h"]),
        owner=OWNERS,
    )
    def retain(self, seq, num_blocks, ttl, retention_class, owner):
        if seq.request_id not in self.manager.sequences:
            return
        stats = self.manager.stats
        refused_before = stats.retention_refused
        kept = self.manager.retain(
            seq, num_blocks * self.block_size, ttl, retention_class, owner=owner
        )
        asked = min(num_blocks, seq.num_stored_blocks)
        assert kept + stats.retention_refused - refused_before == asked
        expiry = self.manager.pool.retention.expiry
        covered = [
            block for block in seq.blocks[:asked] if expiry[block.block_id] >= self.now + ttl
        ]
        assert len(covered) == kept  # each retained block lasts at least as long as asked

    @rule(base=st.sampled_from(BASES), tail=TAILS, salt=SALTS, owner=OWNERS, ttl=TTLS)
    def pin(self, base, tail, salt, owner, ttl):
        """A whole request at once, retained before it is freed: free retained blocks."""
        tokens = base + tail or [0]
        if self._pages(tokens) > self.num_blocks:
            return
        seq = self.manager.admit(self._new_id(), tokens, cache_salt=salt, owner=owner)
        if seq is None:
            return
        for position in range(seq.num_computed_tokens, len(tokens)):
            self._write(seq, position)
        self.manager.commit(seq, len(tokens))
        self.manager.retain(seq, len(tokens), ttl, owner=owner)
        self.manager.free(seq)

    @rule(seconds=st.sampled_from([0.5, 2.0, 10.0, 40.0]))
    def advance_clock(self, seconds):
        self.now += seconds

    @rule(target=sequences, seq=sequences)
    def fork(self, seq):
        if seq.request_id not in self.manager.sequences:
            return multiple()
        return self.manager.fork(seq, self._new_id())

    @rule(seq=consumes(sequences))
    def free(self, seq):
        if seq.request_id in self.manager.sequences:
            self.manager.free(seq)

    @rule()
    def reset(self):
        idle = not self.manager.sequences
        assert self.manager.reset() == idle
        if idle:
            assert not self.manager.pool.cached
            assert all(self.manager.match(base + [0]) == 0 for base in BASES)

    @precondition(lambda self: self.manager.sequences)
    @invariant()
    def live_sequences_read_back_their_own_tokens(self):
        for seq in self.manager.sequences.values():
            for position in range(seq.num_computed_tokens):
                found = self.shadow.get(self._slot(seq, position))
                assert found == seq.token_ids[position], (
                    f"{seq.request_id} position {position}: read {found}, "
                    f"expected {seq.token_ids[position]}"
                )
            self._read_back_windows(seq)

    def _read_back_windows(self, seq) -> None:
        """Each window group reads its own tokens back wherever its window still reads."""
        windows = self.manager.windows
        for group, table in enumerate(seq.window_tables):
            start = windows.needed_from(group, seq.num_computed_tokens) * self.block_size
            for position in range(start, seq.num_computed_tokens):
                block, slot = divmod(position, self.block_size)
                found = self.shadow.get((table[block], slot))
                assert found == seq.token_ids[position], (
                    f"{seq.request_id} window group {group} position {position}: read {found}"
                )

    @invariant()
    def pool_invariants_hold(self):
        self.manager.check_invariants()

    @invariant()
    def events_rebuild_what_every_group_holds(self):
        assert self.event_held == pool_holdings(self.manager)

    def teardown(self):
        for seq in list(self.manager.sequences.values()):
            self.manager.free(seq)
        assert self.manager.num_free_blocks == self.num_blocks
        self.manager.check_invariants()


class SmallBlockMachine(CacheMachine):
    """Block size 2, fewer blocks: more eviction and more copy-on-write."""

    block_size = 2
    num_blocks = 6


def _hybrid(*windows: int) -> tuple[KVGroupSpec, ...]:
    """A full group, then one window group per size."""
    return (KVGroupSpec(1),) + tuple(KVGroupSpec(1, window) for window in windows)


# Each variant: (base machine, class attributes). The same rules must hold in every one.
VARIANTS = {
    # Window groups: pages released mid-run, kept or stale, evicted as tombstones.
    "Hybrid": (CacheMachine, {"groups": _hybrid(6), "num_blocks": 16}),
    "HybridTwoWindows": (SmallBlockMachine, {"groups": _hybrid(3, 5), "num_blocks": 15}),
    "HybridFairRadix": (
        SmallBlockMachine,
        {"groups": _hybrid(4), "num_blocks": 12, "owner_shares": {}, "index": "radix"},
    ),
    "HybridSignals": (SmallBlockMachine, {"groups": _hybrid(5), "eviction_policy": "signals"}),
    "FastHash": (CacheMachine, {"hash_algo": "xxh3_128"}),  # the optional xxh3_128 digest
    "ARC": (SmallBlockMachine, {"eviction_policy": "arc"}),  # many evictions, ARC victims
    "SLRU": (SmallBlockMachine, {"eviction_policy": "slru"}),
    "LFUDA": (SmallBlockMachine, {"eviction_policy": "lfuda"}),
    "Radix": (CacheMachine, {"index": "radix"}),
    "RadixSmallBlock": (SmallBlockMachine, {"index": "radix"}),  # runs split, cut, detached
    "RadixARC": (SmallBlockMachine, {"index": "radix", "eviction_policy": "arc"}),
    # Fair pools: one policy per owner, victims from the owner most over its share.
    "FairEqual": (CacheMachine, {"owner_shares": {}}),
    "FairShares": (SmallBlockMachine, {"owner_shares": {"a": 0.5, "b": 0.25}}),
    "FairARC": (SmallBlockMachine, {"owner_shares": {"a": 0.7}, "eviction_policy": "arc"}),
    "FairSLRU": (SmallBlockMachine, {"owner_shares": {}, "eviction_policy": "slru"}),
    "FairLFUDA": (SmallBlockMachine, {"owner_shares": {"c": 1.0}, "eviction_policy": "lfuda"}),
    "FairSignals": (SmallBlockMachine, {"owner_shares": {}, "eviction_policy": "signals"}),
    "FairRadix": (SmallBlockMachine, {"owner_shares": {"b": 0.5}, "index": "radix"}),
}
# The two base machines run 150 examples; each variant 100 (it re-runs their rules with one
# option changed, and 14 of them are the suite's longest property run).
STATEFUL_SETTINGS = settings(max_examples=150, stateful_step_count=40, deadline=None)
VARIANT_SETTINGS = settings(STATEFUL_SETTINGS, max_examples=100)
TestCacheMachine = CacheMachine.TestCase
TestSmallBlockMachine = SmallBlockMachine.TestCase
for machine_test in (TestCacheMachine, TestSmallBlockMachine):
    machine_test.settings = STATEFUL_SETTINGS
for variant, (base, attributes) in VARIANTS.items():
    machine = type(f"{variant}Machine", (base,), attributes)
    machine.TestCase.settings = VARIANT_SETTINGS
    globals()[f"Test{variant}Machine"] = machine.TestCase
del machine_test, machine  # module-level TestCase aliases would be collected twice
