"""Continuous batching over the cache manager: token budget, admission, preemption.

Each step runs the running branches first (one decode token each, or the next chunk
of a prefill), then admits waiting branches while the token budget, the cap on running
sequences and the pool allow. Tokens are committed to the cache *as they are
scheduled*: the model writes every layer's K/V for the whole batch before attention
reads it (rule 9 of docs/design.md), so a request admitted later in the same step can already
reuse a prefix that an earlier one is computing in this very step. Sixty-four requests
with one system prompt, sent at once, prefill it once.

In a tenant-fair pool a branch whose admission would evict another tenant's cached blocks
while that tenant is within its share of the pool waits, as long as its own tenant has
branches running (so every tenant progresses); other tenants' branches go ahead of it.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from prefixcache.cache import KVCacheManager
from prefixcache.engine.request import Branch


class BlockLoader(Protocol):
    """Fills a newly admitted branch's blocks from elsewhere (a second KV tier)."""

    def ready(self, branch: Branch) -> bool:
        """Whether ``branch`` may be admitted now (its blocks are not on their way)."""

    def load(self, branch: Branch) -> int:
        """Copy what is available into the branch's new blocks and commit them; how many."""


class Room(enum.Enum):
    """What ``append_token`` did for a branch's next token."""

    APPENDED = "appended"
    PREEMPTED = "preempted"
    NONE = "none"  # not even a pool to itself holds it


@dataclass(slots=True)
class ScheduledChunk:
    """``num_tokens`` new tokens of ``branch``, starting at position ``start``."""

    branch: Branch
    start: int
    num_tokens: int

    @property
    def needs_logits(self) -> bool:
        """Whether this chunk reaches the branch's last token (so it samples one)."""
        assert self.branch.seq is not None
        return self.start + self.num_tokens == self.branch.seq.num_tokens


class Scheduler:
    """Decides which branches run in the next step, and how many tokens each."""

    def __init__(
        self,
        manager: KVCacheManager,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        cache_aware: bool = False,
        max_passed_over: int = 8,
        loader: BlockLoader | None = None,
    ) -> None:
        self.manager = manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.cache_aware = cache_aware
        self.max_passed_over = max_passed_over
        self.loader = loader  # a second tier's blocks, loaded at admission
        self.waiting: deque[Branch] = deque()
        self.running: list[Branch] = []
        self._arrivals = 0
        self.num_preemptions = 0
        self.num_fair_deferrals = 0  # admissions put off so as not to crowd out another owner

    def add(self, branch: Branch) -> None:
        """Queue a new branch for admission."""
        self._arrivals += 1
        branch.arrival = self._arrivals
        self.waiting.append(branch)

    def schedule(self) -> list[ScheduledChunk]:
        """The next step's batch; commits its tokens to the cache before it runs."""
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        for branch in self.running:
            if budget == 0:
                break
            chunk = self._next_chunk(branch, budget)
            chunks.append(chunk)
            budget -= chunk.num_tokens
        admitted = []
        busy, deferred = self._busy_owners(), set()
        for branch in self._admission_order():
            if budget == 0 or len(self.running) >= self.max_num_seqs:
                break
            if self.loader is not None and not self.loader.ready(branch):
                continue  # its prompt's blocks are on their way from the tier
            owner = branch.request.owner
            if owner in deferred or (owner in busy and self._crowds_out(branch)):
                deferred.add(owner)  # it waits for its own blocks; others may go first
                continue
            if not self._admit(branch):
                break  # the pool is full: wait for blocks to free up
            admitted.append(branch)
            busy.add(owner)
            chunk = self._next_chunk(branch, budget)
            chunks.append(chunk)
            budget -= chunk.num_tokens
        self._count_passed_over(admitted)
        return chunks

    def _next_chunk(self, branch: Branch, budget: int) -> ScheduledChunk:
        """The branch's uncomputed tokens, up to ``budget``, committed right away."""
        seq = branch.seq
        assert seq is not None
        start = seq.num_computed_tokens
        count = min(seq.num_tokens - start, budget)
        self.manager.commit(seq, start + count)
        if start + count == seq.num_prompt_tokens and branch.request.retention:
            self._retain(branch)
        return ScheduledChunk(branch, start, count)

    def _retain(self, branch: Branch) -> None:
        """The prompt is committed: mark the prefixes its request asked to keep."""
        request, seq = branch.request, branch.seq
        assert seq is not None
        for i, keep in enumerate(request.retention):
            kept = self.manager.retain(seq, *keep, owner=request.owner)
            request.retained_blocks[i] = max(request.retained_blocks[i], kept)

    def _admit(self, branch: Branch) -> bool:
        """Give a waiting branch its blocks (reusing its cached prefix) and run it."""
        request = branch.request
        start = time.perf_counter()
        seq = self.manager.admit(
            branch.id,
            branch.token_ids,
            cache_salt=request.cache_salt,
            min_hit_tokens=request.min_hit_tokens,
            owner=request.owner,
        )
        request.metrics.lookup_seconds += time.perf_counter() - start
        if seq is None:
            return False
        branch.seq = seq
        if self.loader is not None:
            self.loader.load(branch)
        if request.num_cached_tokens is None:
            request.num_cached_tokens = seq.num_cached_tokens
        self.waiting.remove(branch)
        self.running.append(branch)
        return True

    def _busy_owners(self) -> set[str | None]:
        """Owners with a running branch, in a fair pool (else none: nobody is deferred)."""
        if self.manager.owners is None:
            return set()
        return {branch.request.owner for branch in self.running}

    def _crowds_out(self, branch: Branch) -> bool:
        """Whether admitting ``branch`` would evict another owner's blocks within its share;
        such a branch waits while its owner has others running (so it always progresses)."""
        request = branch.request
        crowds = self.manager.would_crowd_out(
            branch.token_ids,
            request.cache_salt,
            min_hit_tokens=request.min_hit_tokens,
            owner=request.owner,
        )
        self.num_fair_deferrals += crowds
        return crowds

    def _admission_order(self) -> list[Branch]:
        """FCFS; or longest cached prefix first, except that a branch passed over
        ``max_passed_over`` times goes ahead of everything (no starvation)."""
        if not self.cache_aware or len(self.waiting) < 2:
            return list(self.waiting)
        starving = [b for b in self.waiting if b.passed_over >= self.max_passed_over]
        rest = [b for b in self.waiting if b.passed_over < self.max_passed_over]
        rest.sort(key=self._cached_tokens, reverse=True)  # stable: FCFS among equals
        return starving + rest

    def _count_passed_over(self, admitted: list[Branch]) -> None:
        """Every waiting branch that arrived before an admitted one was passed over."""
        if admitted:
            latest = max(branch.arrival for branch in admitted)
            for branch in self.waiting:
                if branch.arrival < latest:
                    branch.passed_over += 1

    def _cached_tokens(self, branch: Branch) -> int:
        request = branch.request
        return self.manager.match(
            branch.token_ids, request.cache_salt, min_hit_tokens=request.min_hit_tokens
        )

    def add_forks(self, parent: Branch, children: list[Branch]) -> None:
        """Run ``children`` beside ``parent``, sharing its blocks (copy-on-write tail)."""
        assert parent.seq is not None
        for child in children:
            child.seq = self.manager.fork(parent.seq, child.id)
            self.running.append(child)

    def append_token(self, branch: Branch, token: int) -> Room:
        """Give ``token`` a KV slot, preempting the newest running branches while needed."""
        assert branch.seq is not None
        while not self.manager.append(branch.seq, [token]):
            if self.preempt_last() is branch:
                if self.running:
                    return Room.PREEMPTED  # it waits, to be recomputed
                self.waiting.remove(branch)  # alone and still no room: it can never grow
                return Room.NONE
        return Room.APPENDED

    def preempt_last(self) -> Branch:
        """Free the most recently admitted running branch; it will be recomputed."""
        victim = self.running.pop()
        self._release(victim)
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        return victim

    def finish(self, branch: Branch) -> None:
        """Drop a branch that has finished or been aborted, freeing its blocks."""
        if branch in self.running:
            self.running.remove(branch)
        elif branch in self.waiting:
            self.waiting.remove(branch)
        self._release(branch)

    def _release(self, branch: Branch) -> None:
        if branch.seq is not None:
            self.manager.free(branch.seq)
            branch.seq = None
