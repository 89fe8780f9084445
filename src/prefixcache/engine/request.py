"""Requests, their branches (one per completion), and what the engine reports."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prefixcache.cache import Sequence
from prefixcache.cache.retention import Keep
from prefixcache.engine.logprobs import Logprob
from prefixcache.engine.sampling import make_generator
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.engine.stop_holdback import releasable_length, released_tokens, visible_tokens
from prefixcache.engine.tokenizer import IncrementalDecoder

if TYPE_CHECKING:
    from prefixcache.engine.constrained import GrammarState
    from prefixcache.engine.tier_link import PendingFetch


class FinishReason(enum.StrEnum):
    """Why a completion ended (the strings OpenAI clients expect)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock milestones of one request (``time.perf_counter`` seconds)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prefill_tokens: int = 0  # prompt tokens the model computed (not reused)
    lookup_seconds: float = 0.0  # time spent in the cache's admission lookups
    queue_seconds: dict[str, float] = field(default_factory=dict)  # waits by reason (timed)

    @property
    def ttft(self) -> float | None:
        """Time to first token, in seconds."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass(slots=True)
class CompletionOutput:
    """One completion of a request: its text so far and why it stopped.

    In a snapshot of an unfinished request, ``text`` holds back what could still become a
    stop string, and ``logprobs`` (if asked for) covers the tokens whose text is shown.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    logprobs: list[Logprob] | None = None
    text_ends: list[int] = field(default_factory=list)  # len(text) after each token (engine)


@dataclass(slots=True)
class RequestOutput:
    """The state of a request's completions; ``text``/``token_ids`` are the first one's."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int
    metrics: RequestMetrics
    finished: bool = False
    num_tier_tokens: int = 0  # of num_cached_tokens, those loaded from the second tier
    prompt_logprobs: list[Logprob | None] | None = None  # [0] is None: nothing precedes it
    retained_blocks: tuple[int, ...] = ()  # per retention ask: prompt blocks it retained

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids


class Request:
    """What a user asked for: a prompt, sampling parameters, and ``n`` completions."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        seed: int = 0,
        min_hit_tokens: int = 0,
        zero_on_evict: bool = False,
        new_decoder: Callable[[], IncrementalDecoder] | None = None,
        use_tier: bool = True,
        owner: str | None = None,
        previous_cache_salt: str | None = None,
        retention: tuple[Keep, ...] = (),
        cache_key: str | None = None,
        new_grammar: Callable[[], GrammarState] | None = None,
        priority: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.cache_salt = cache_salt
        self.previous_cache_salt = previous_cache_salt  # a secret rotation: tier reads only
        self.retention = retention  # prompt prefixes to keep cached once computed
        self.priority = priority  # lower runs first (vLLM's meaning)
        self.cache_key = cache_key  # a client's opaque per-tenant id: for traces and logs only
        self.retained_blocks = [0] * len(retention)  # per retention ask: prompt blocks retained
        self.min_hit_tokens = min_hit_tokens  # a shorter cache hit is recomputed
        self.zero_on_evict = zero_on_evict  # zero its blocks before their slots are reused
        self.seed = params.seed if params.seed is not None else seed
        self.metrics = RequestMetrics(arrival_time=time.perf_counter())
        self.num_cached_tokens: int | None = None  # at first admission, pool and tier
        self.use_tier = use_tier  # read and write the second KV tier, if there is one
        self.owner = owner  # whose cache share its freed blocks count against (fair cache)
        self.num_tier_tokens = 0  # of the cached tokens, those loaded from the tier
        self.tier_fetch: PendingFetch | None = None  # its prompt blocks on their way
        self._new_decoder = new_decoder  # None: token ids only (scheduler tests)
        self._new_grammar = new_grammar  # a fresh matcher per branch, if constrained
        self.branches: list[Branch] = [Branch(self, 0, self._decoder())]
        wants_logprobs = params.logprobs is not None
        self.outputs = [
            CompletionOutput(index=i, logprobs=[] if wants_logprobs else None)
            for i in range(params.n)
        ]
        self.prompt_logprobs: list[Logprob | None] | None = (
            None if params.prompt_logprobs is None else [None] * len(prompt_token_ids)
        )
        self._prompt_logprobs_done = False

    def fork_branches(self) -> list[Branch]:
        """Branches 1..n-1, made when branch 0 samples its first token (they share its KV)."""
        children = [Branch(self, i, self._decoder()) for i in range(1, self.params.n)]
        self.branches += children
        return children

    def _decoder(self) -> IncrementalDecoder | None:
        return self._new_decoder() if self._new_decoder else None

    def new_grammar(self) -> GrammarState | None:
        """A branch's own matcher at the grammar's start (None: unconstrained)."""
        return self._new_grammar() if self._new_grammar else None

    @property
    def prompt_length(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return all(output.finish_reason is not None for output in self.outputs)

    def snapshot(self) -> RequestOutput:
        """A copy of the request's current state, safe to hand to another thread."""
        return RequestOutput(
            self.request_id,
            self.prompt_token_ids,
            [self._shown(o) for o in self.outputs],
            self.num_cached_tokens or 0,
            self.metrics,
            self.finished,
            self.num_tier_tokens,
            self._prompt_logprobs_if_done(),
            tuple(self.retained_blocks),
        )

    def _shown(self, output: CompletionOutput) -> CompletionOutput:
        """What may be shown of one completion: no text that may yet start a stop string."""
        if output.finish_reason is None:
            length = releasable_length(output.text, self.params.stop)
            count = released_tokens(output.text_ends, length)
        else:
            length = len(output.text)
            count = visible_tokens(output.text_ends, length)
        logprobs = None if output.logprobs is None else output.logprobs[:count]
        return CompletionOutput(
            output.index, output.text[:length], list(output.token_ids), output.finish_reason,
            logprobs,
        )  # fmt: skip

    def _prompt_logprobs_if_done(self) -> list[Logprob | None] | None:
        """The prompt's logprobs once every position has one (after its prefill)."""
        slots = self.prompt_logprobs
        if slots is None:
            return None
        if not self._prompt_logprobs_done:  # filled once, never changed after
            self._prompt_logprobs_done = all(entry is not None for entry in slots[1:])
        return slots if self._prompt_logprobs_done else None


class Branch:
    """One completion being generated: the scheduler's unit of work."""

    def __init__(self, request: Request, index: int, decoder: IncrementalDecoder | None) -> None:
        self.request = request
        self.index = index
        self.decoder = decoder  # token ids -> text, one token at a time
        self.grammar = request.new_grammar()  # follows output.token_ids (constrained.py)
        self.seq: Sequence | None = None  # cache-side blocks, while admitted
        self.generator = make_generator(request.seed + index)
        self.arrival = 0  # FCFS position, set by the scheduler
        self.passed_over = 0  # times a later arrival was admitted first
        self.num_preemptions = 0
        self.num_pauses = 0  # times a higher-priority arrival paused its prefill
        self.skipped_steps = 0  # steps in a row its running prefill got no chunk
        self.uncached: int | None = None  # while waiting: tokens past its hit, last matched

    @property
    def id(self) -> str:
        return f"{self.request.request_id}#{self.index}"

    @property
    def output(self) -> CompletionOutput:
        return self.request.outputs[self.index]

    @property
    def token_ids(self) -> list[int]:
        """Prompt followed by what this branch generated: what its KV must cover."""
        return self.request.prompt_token_ids + self.output.token_ids

    @property
    def finished(self) -> bool:
        return self.output.finish_reason is not None
