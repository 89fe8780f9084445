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

With a step target (seconds), a step is sized in time by an online cost model
(``step_cost.py``): running decodes first, then prefills, running or waiting, in the
order: aged ones first by arrival, then lower ``priority`` number, least uncached work,
arrival. Each gets the tokens that fit in what is left of the target. The target binds
only when more than one branch is in the scheduler or was within ``SHARED_HOLD``; the
first prefill of a step, and any aged one, gets at least ``MIN_PREFILL_CHUNK`` tokens. A
branch passed over ``max_passed_over`` times (by later arrivals while waiting, or by steps
without a chunk while running) ages and goes ahead of everything: no request starves. A
waiting branch that finds no seat or no room may pause a running prefill of a larger
priority number at its chunk boundary: the paused branch's committed blocks stay cached.

With ``interleave``, a prompt that ``LONG_PROMPT_STEPS`` target steps of its own cannot
finish does not go in short chunks: it takes a step of its own, up to ``LONG_STEP_TOKENS``
(as efficient as a step sized in tokens), and between its layers the engine runs *urgent*
steps (decodes, and the other prompts, timed) over every other branch
(``schedule_urgent``). The long step's branches are ``in_flight`` until it lands: no
urgent step schedules, pauses or preempts them, and a prompt whose cached prefix reaches
blocks the long step is still writing waits for it.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from prefixcache.cache import KVCacheManager
from prefixcache.cache.common import cdiv
from prefixcache.engine.request import Branch
from prefixcache.engine.step_cost import StepCost, StepShape, StepTimes, chunk_attention

WAIT_REASONS = ("step_time", "priority", "seats", "memory", "tier_load", "fairness")
MIN_PREFILL_CHUNK = 32  # tokens the first prefill of a step gets, whatever the target
# A step that gives a request its first token (its prompt's last chunk) takes middle chunks
# of other prompts only up to this share of the target (whole prompts' ends still up to the
# target): that request's TTFT is this step, and a long prompt loses one short step
# (docs/benchmarks.md, issue 36: agents' TTFT beside a flood, over HTTP).
FIRST_TOKEN_STEP_SHARE = 0.25
# The target keeps binding this long (seconds) after the scheduler last held more than one
# branch: a client sending prompts back to back leaves one alone for the milliseconds
# between them, and that one's whole prompt in a single step (1.3 s for 1,500 SmolLM2
# tokens) was what an agent arriving then waited for (a TTFT p95 of 15x over HTTP). Held 1 s,
# the 2,000-token prompt behind eight agents went on in short steps well after they were
# done (1.20-1.33x of alone, against 1.09-1.17x at 0.25 s).
SHARED_HOLD = 0.25
# A long prompts' step (``interleave``) takes at most this many tokens: an urgent arrival
# waits for at most half of one of its layers (~17 ms for SmolLM2 on two cores), and
# 1,024-token steps prefill within a few percent of 2,048-token ones.
LONG_STEP_TOKENS = 1024
# A prompt is long (``interleave``) when this many target steps of its own cannot finish it.
# Shorter ones go in timed chunks: an agent's turn of ~100 new tokens (two target steps)
# took a 1,024-token long step beside the flood's prompts, a TTFT of 2 s instead of 0.2.
LONG_PROMPT_STEPS = 4


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


@dataclass(slots=True)
class _Admission:
    """One timed step's admissions so far: owners running, owners deferred, admitted."""

    busy: set[str | None]
    deferred: set[str | None] = field(default_factory=set)
    admitted: list[Branch] = field(default_factory=list)
    blocked: str = ""  # why the first waiting branch that found no seat or room waits


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
        step_target: float | None = None,
        step_cost: StepCost | None = None,
        clock: Callable[[], float] = time.monotonic,
        interleave: bool = False,
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
        self.step_target = step_target  # seconds a step should take; None: tokens only
        self.step_cost = step_cost or StepCost()
        self.last_shape = StepShape()  # of the latest schedule(), for observe_step
        self.step_times = StepTimes()  # measured forwards, for the metrics
        self.num_pauses = 0  # running prefills paused for a higher-priority arrival
        self.last_waits: dict[str, int] = {}  # latest timed step: branches left waiting, why
        self.queue_seconds: dict[str, float] = dict.fromkeys(WAIT_REASONS, 0.0)
        self._left_waiting: list[tuple[Branch, str]] = []  # latest timed step's, and why
        self._paused: set[Branch] = set()  # paused in the step being built
        self.clock = clock  # seconds, for SHARED_HOLD and urgent decodes
        self._shared_until = -float("inf")  # the target binds until then
        self.interleave = interleave and step_target is not None
        self.in_flight: set[Branch] = set()  # the long prompts' step being computed
        self._in_flight_blocks: set[int] = set()  # blocks that step is still writing
        self._last_decode = -float("inf")  # when a step last carried decode rows
        self.num_long_steps = 0  # long prompts' own steps (interleave)
        self.num_urgent_steps = 0  # steps run between a long step's layers
        self._tried_arrivals = 0  # arrivals up to this one were offered an urgent step

    def add(self, branch: Branch) -> None:
        """Queue a new branch for admission."""
        self._arrivals += 1
        branch.arrival = self._arrivals
        self.waiting.append(branch)

    def schedule(self) -> list[ScheduledChunk]:
        """The next step's batch; commits its tokens to the cache before it runs. With
        ``interleave``, long prompts' steps are ``in_flight`` until ``land``."""
        assert not self.in_flight, "the long prompts' step has not landed"
        if self.step_target is None:
            return self._scheduled(self._schedule_tokens())
        chunks, order = [], self._prefill_order()
        if self.interleave and (long := [(b, n) for b, n in order if self._is_long(b, n)]):
            chunks = self._schedule_long(long)
        if chunks:
            self.num_long_steps += 1
        else:  # none long, or none of them can run now (seats, memory, ...)
            chunks = self._schedule_timed(self.step_target, order=order)
        return self._scheduled(chunks)

    def schedule_urgent(self) -> list[ScheduledChunk]:
        """Between the long prompts' step's layers: decodes and prompts that are not long,
        over every branch but that step's."""
        assert self.step_target is not None
        chunks = self._schedule_timed(self.step_target, urgent=True)
        self._tried_arrivals = self._arrivals  # every short one waiting had its chance
        self.num_urgent_steps += bool(chunks)
        return self._scheduled(chunks)

    def _scheduled(self, chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
        self.last_shape = step_shape(chunks)
        if self.last_shape.decode_rows:
            self._last_decode = self.clock()
        return chunks

    def urgent_due(self) -> bool:
        """Whether an urgent step should run now, during the long prompts' step: a prompt
        that is not long arrived or runs, or decodes have waited half a target (their gap is
        then up to that, half a layer of the long step and their own step)."""
        assert self.step_target is not None
        for branch in self.waiting:  # arrived since the last try: one that waits still waits
            if branch.arrival <= self._tried_arrivals:
                continue
            if branch.uncached is None:  # arrived during the step: its hit, once
                branch.uncached = len(branch.token_ids) - self.cached_tokens(branch)
            if not self._is_long(branch, branch.uncached):
                return True
        others = [b for b in self.running if b not in self.in_flight]
        if any(not is_decode(b) and not self._is_long(b, remaining(b)) for b in others):
            return True
        due = self.clock() - self._last_decode >= self.step_target / 2
        return due and any(is_decode(b) for b in others)

    def land(self) -> None:
        """The long prompts' step is computed (or failed): its branches are free again."""
        self.in_flight.clear()
        self._in_flight_blocks.clear()

    def _in_long_step(self, branch: Branch, uncached: int) -> bool:
        """In the long step being computed, or long: for one of its own, not urgent."""
        return branch in self.in_flight or self._is_long(branch, uncached)

    def _is_long(self, branch: Branch, uncached: int) -> bool:
        """Whether ``uncached`` more tokens of ``branch`` exceed ``LONG_PROMPT_STEPS``
        target steps of their own."""
        assert self.step_target is not None
        start = prefill_start(branch, uncached)
        span = LONG_PROMPT_STEPS * self.step_target
        return self.step_cost.tokens_fitting(StepShape(), start, uncached, span) < uncached

    def _schedule_long(self, long: list[tuple[Branch, int]]) -> list[ScheduledChunk]:
        """The long prompts' own step: each as much as the budget left, in order."""
        budget = min(self.max_num_batched_tokens, LONG_STEP_TOKENS)
        admission = _Admission(self._busy_owners())
        chunks: list[ScheduledChunk] = []
        prefilled: set[Branch] = set()
        waits: dict[Branch, str] = {}
        self._paused.clear()
        for branch, _ in long:
            if budget == 0:
                break
            if why := self._why_not_now(branch, admission, prefilled):
                waits[branch] = why
                continue
            chunk = self._next_chunk(branch, budget)
            chunks.append(chunk)
            prefilled.add(branch)
            budget -= chunk.num_tokens
        self._count_step(admission, prefilled, waits)
        self._fly(chunks)
        return chunks

    def _fly(self, chunks: list[ScheduledChunk]) -> None:
        """Mark a long step's branches and the blocks it writes as in flight."""
        size = self.manager.block_size
        for chunk in chunks:
            assert chunk.branch.seq is not None
            table = chunk.branch.seq.block_table
            end = cdiv(chunk.start + chunk.num_tokens, size)
            self._in_flight_blocks.update(table[chunk.start // size : end])
            self.in_flight.add(chunk.branch)

    def observe_step(self, seconds: float, shape: StepShape | None = None) -> None:
        """A step of ``shape`` (the latest scheduled) took ``seconds``: refit the cost model,
        count it."""
        self.step_cost.observe(self.last_shape if shape is None else shape, seconds)
        self.step_times.observe(seconds)
        for reason, count in self.last_waits.items():  # each waiting branch waited it out
            self.queue_seconds[reason] += count * seconds
        for branch, reason in self._left_waiting:
            waits = branch.request.metrics.queue_seconds
            waits[reason] = waits.get(reason, 0.0) + seconds

    def _schedule_tokens(self) -> list[ScheduledChunk]:
        """Running branches first, then admissions, under the token budget only."""
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

    def _schedule_timed(
        self,
        target: float,
        urgent: bool = False,
        order: list[tuple[Branch, int]] | None = None,
    ) -> list[ScheduledChunk]:
        """Decodes first, then prefills in priority order, each sized to the time left.
        ``urgent``: none of the long step's branches and no long prompt; the target binds
        only for decodes or more than one prompt (a lone prompt is at most a few steps)."""
        budget = self.max_num_batched_tokens
        decodes = [b for b in self.running if is_decode(b) and b not in self.in_flight]
        chunks = [self._next_chunk(b, 1) for b in decodes[:budget]]
        budget -= len(chunks)
        shape = step_shape(chunks)  # what the step costs so far
        prefills = self._prefill_order() if order is None else order
        if urgent:
            prefills = [(b, n) for b, n in prefills if not self._in_long_step(b, n)]
            binding = bool(decodes) or len(prefills) > 1
        else:
            binding = self._target_binds()
        admission = _Admission(self._busy_owners())
        prefilled: set[Branch] = set()
        waits: dict[Branch, str] = {}  # why a waiting branch was not admitted
        first_token_step = False  # a chunk of this step ends its prompt
        self._paused.clear()
        for branch, uncached in prefills:
            if budget == 0:
                break
            start = prefill_start(branch, uncached)
            room = budget
            if binding:
                limit = min(uncached, budget)
                room = self.step_cost.tokens_fitting(shape, start, limit, target)
                if first_token_step and room < uncached:  # a middle chunk: held short
                    short = FIRST_TOKEN_STEP_SHARE * target
                    room = self.step_cost.tokens_fitting(shape, start, limit, short)
            if not prefilled or self._aged(branch):  # progress, whatever the target
                room = max(room, min(MIN_PREFILL_CHUNK, budget))
            if room == 0:
                break
            if why := self._why_not_now(branch, admission, prefilled):
                waits[branch] = why
                continue
            chunk = self._next_chunk(branch, room)
            chunks.append(chunk)
            shape = shape.with_prefill(chunk.start, chunk.num_tokens)
            prefilled.add(branch)
            budget -= chunk.num_tokens
            first_token_step = first_token_step or gives_first_token(chunk)
        self._count_step(admission, prefilled, waits)
        return chunks

    def _why_not_now(
        self, branch: Branch, admission: _Admission, prefilled: set[Branch]
    ) -> str | None:
        """Why a prefill cannot go in this step (a ``WAIT_REASONS`` name); None if it can,
        a waiting one admitted."""
        if branch in self._paused:  # paused in this step: not back before the next
            return "priority"
        if branch.seq is None:
            return self._admit_or_why_not(branch, admission, prefilled)
        return None

    def _count_step(
        self, admission: _Admission, prefilled: set[Branch], waits: dict[Branch, str]
    ) -> None:
        """A timed or long step is built: who was passed over, left out, left waiting."""
        self._count_passed_over(admission.admitted)
        self._count_skipped(prefilled)
        self._count_waits(waits, prefilled)

    def _target_binds(self) -> bool:
        """More than one branch is here, or was less than ``SHARED_HOLD`` seconds ago."""
        now = self.clock()
        if len(self.running) + len(self.waiting) > 1:
            self._shared_until = now + SHARED_HOLD
        return now < self._shared_until

    def _admit_or_why_not(
        self, branch: Branch, admission: _Admission, prefilled: set[Branch]
    ) -> str | None:
        """Admit a waiting branch (None), or say why it waits (a ``WAIT_REASONS`` name)."""
        owner = branch.request.owner
        if admission.blocked:  # one found no seat or room: none behind it may pass
            return admission.blocked
        if self.loader is not None and not self.loader.ready(branch):
            return "tier_load"  # its prompt's blocks are on their way from the tier
        if self._in_flight_blocks and self._reads_in_flight(branch):
            return "step_time"  # its prefix is being computed by the long step
        if owner in admission.deferred or (owner in admission.busy and self._crowds_out(branch)):
            admission.deferred.add(owner)  # it waits for its own blocks; others may go first
            return "fairness"
        if not self._seat(branch, prefilled):  # even by pausing; running ones go on
            admission.blocked = "seats" if len(self.running) >= self.max_num_seqs else "memory"
            return admission.blocked
        admission.admitted.append(branch)
        admission.busy.add(owner)
        branch.passed_over = 0  # it had its turn: running, only skipped steps age it
        return None

    def _reads_in_flight(self, branch: Branch) -> bool:
        """Whether ``branch``'s cached prefix reaches blocks the long step is still writing
        (committed at schedule time, rule 9's exception, but not yet computed)."""
        request = branch.request
        hits = self.manager.matched_block_ids(
            branch.token_ids, request.cache_salt, min_hit_tokens=request.min_hit_tokens
        )
        return not self._in_flight_blocks.isdisjoint(hits)

    def _count_waits(self, waits: dict[Branch, str], prefilled: set[Branch]) -> None:
        """Why each branch still waiting waits: its own reason, else more urgent work in the
        step (``priority``), else the step's time."""
        urgent = min((b.request.priority for b in prefilled), default=0)

        def reason(branch: Branch) -> str:
            if branch in waits:
                return waits[branch]
            return "priority" if branch.request.priority > urgent else "step_time"

        self._left_waiting = [(b, reason(b)) for b in self.waiting]
        counts = dict.fromkeys(WAIT_REASONS, 0)
        for _, reason in self._left_waiting:
            counts[reason] += 1
        self.last_waits = counts

    def _prefill_order(self) -> list[tuple[Branch, int]]:
        """Running prefills and waiting branches with their uncached tokens, in the order:
        aged ones by arrival, then by (priority, uncached tokens, arrival). Each waiting
        branch keeps its count (``Branch.uncached``, for ``pending_prefill_tokens``)."""
        found = [(b, remaining(b)) for b in self.running if not is_decode(b)]
        for branch in self.waiting:
            branch.uncached = len(branch.token_ids) - self.cached_tokens(branch)
            found.append((branch, branch.uncached))

        def key(item: tuple[Branch, int]) -> tuple[int, ...]:
            branch, uncached = item
            if self._aged(branch):  # the aged go first, first come first served
                return (0, branch.arrival)
            return (1, branch.request.priority, uncached, branch.arrival)

        return sorted(found, key=key)

    def _aged(self, branch: Branch) -> bool:
        """Passed over (or left out while running) often enough to go ahead of everything."""
        return max(branch.passed_over, branch.skipped_steps) >= self.max_passed_over

    def _seat(self, branch: Branch, prefilled: set[Branch]) -> bool:
        """Admit ``branch``, pausing running prefills of a larger priority number if it
        finds no seat or no room; False if it still cannot run."""
        while True:
            if len(self.running) < self.max_num_seqs and self._admit(branch):
                return True
            victim = self._pausable(branch.request.priority, prefilled)
            if victim is None:
                return False
            self._pause(victim)

    def _pausable(self, priority: int, prefilled: set[Branch]) -> Branch | None:
        """The running prefill with the largest priority number above ``priority`` (not one
        already in this step, nor an aged one: a pause must not starve it)."""
        prefills = [
            b
            for b in self.running
            if not is_decode(b)
            and b.request.priority > priority
            and b not in prefilled
            and b not in self.in_flight
            and not self._aged(b)
        ]
        if not prefills:
            return None
        return max(prefills, key=lambda b: (b.request.priority, b.arrival))

    def _pause(self, branch: Branch) -> None:
        """Stop a running prefill at its chunk boundary; its committed blocks stay cached."""
        self.running.remove(branch)
        self._release(branch)
        branch.num_pauses += 1
        self.num_pauses += 1
        self._paused.add(branch)
        self.waiting.appendleft(branch)

    def _count_skipped(self, prefilled: set[Branch]) -> None:
        """Running prefills left out of a step that had prefill work age; others reset."""
        for branch in self.running:
            if branch in prefilled:
                branch.skipped_steps = 0
            elif prefilled and not is_decode(branch) and branch not in self.in_flight:
                branch.skipped_steps += 1

    def _next_chunk(self, branch: Branch, budget: int) -> ScheduledChunk:
        """The branch's uncomputed tokens, up to ``budget``, committed right away."""
        seq = branch.seq
        assert seq is not None
        start = seq.num_computed_tokens
        count = min(seq.num_tokens - start, budget)
        self.manager.commit(seq, start + count, reading_from=start)
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
        rest.sort(key=self.cached_tokens, reverse=True)  # stable: FCFS among equals
        return starving + rest

    def _count_passed_over(self, admitted: list[Branch]) -> None:
        """Every waiting branch that arrived before an admitted one was passed over."""
        if admitted:
            latest = max(branch.arrival for branch in admitted)
            for branch in self.waiting:
                if branch.arrival < latest:
                    branch.passed_over += 1

    def pending_prefill_tokens(self) -> int:
        """Prompt tokens still to compute: running prefills' rest, and each waiting branch's
        past its prefix hit as last matched (its whole prompt before a first match)."""
        running = sum(remaining(b) for b in self.running if not is_decode(b))
        waiting = (len(b.token_ids) if b.uncached is None else b.uncached for b in self.waiting)
        return running + sum(waiting)

    def cached_tokens(self, branch: Branch) -> int:
        """Tokens of ``branch`` its prefix hit in the pool would cover now (changes nothing)."""
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
        """Free the most recently admitted running branch (not one the long step is
        computing); it will be recomputed."""
        victim = next(b for b in reversed(self.running) if b not in self.in_flight)
        self.running.remove(victim)
        self._release(victim)
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        return victim

    def finish(self, branch: Branch) -> None:
        """Drop a branch that has finished or been aborted, freeing its blocks."""
        assert branch not in self.in_flight, "a branch left while its step was computed"
        if branch in self.running:
            self.running.remove(branch)
        elif branch in self.waiting:
            self.waiting.remove(branch)
        self._release(branch)

    def _release(self, branch: Branch) -> None:
        if branch.seq is not None:
            self.manager.free(branch.seq)
            branch.seq = None


def gives_first_token(chunk: ScheduledChunk) -> bool:
    """The chunk ends its branch's prompt: the step samples the branch's first token."""
    seq = chunk.branch.seq
    return seq is not None and chunk.start + chunk.num_tokens == seq.num_prompt_tokens


def is_decode(branch: Branch) -> bool:
    """A running branch whose prompt is computed: one new token a step."""
    seq = branch.seq
    assert seq is not None
    return seq.num_computed_tokens >= seq.num_tokens - 1 and bool(branch.output.token_ids)


def prefill_start(branch: Branch, uncached: int) -> int:
    """Where a prefill of ``uncached`` more tokens starts: past the hit of a waiting branch,
    past what a running one computed."""
    return len(branch.token_ids) - uncached if branch.seq is None else computed(branch)


def computed(branch: Branch) -> int:
    """A running branch's tokens already computed (or scheduled)."""
    assert branch.seq is not None
    return branch.seq.num_computed_tokens


def remaining(branch: Branch) -> int:
    """A running branch's tokens still to compute."""
    assert branch.seq is not None
    return branch.seq.num_tokens - branch.seq.num_computed_tokens


def step_shape(chunks: list[ScheduledChunk]) -> StepShape:
    """Prefill tokens, token·context work and decode rows of a step's chunks."""
    prefill, attention, decodes = 0, 0.0, 0
    for chunk in chunks:
        attention += chunk_attention(chunk.start, chunk.num_tokens)
        if chunk.num_tokens == 1 and chunk.branch.output.token_ids:
            decodes += 1
        else:
            prefill += chunk.num_tokens
    return StepShape(prefill, attention, decodes)
