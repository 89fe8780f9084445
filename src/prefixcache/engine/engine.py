"""LLMEngine: one step = schedule, one forward over the whole batch, sample, postprocess."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch
from torch import nn

from prefixcache.cache import KVCacheManager, Namespace
from prefixcache.cache.common import DEFAULT_BLOCK_SIZE
from prefixcache.cache.events import EventSink
from prefixcache.cache.index import DEFAULT_INDEX
from prefixcache.cache.observer import KeyLogObserver
from prefixcache.cache.policies import DEFAULT_POLICY
from prefixcache.cache.retention import DEFAULT_SHARE, Keep
from prefixcache.cache.validation import check_fits, check_keeps
from prefixcache.engine.config import (
    DEFAULT_DECODE_ACTIVATIONS,
    DEFAULT_KV_CACHE_BYTES,
    DEFAULT_KV_LAYOUT,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
)
from prefixcache.engine.constrained import GrammarState, advance, allowed_masks
from prefixcache.engine.forward_batch import ForwardBatch
from prefixcache.engine.grammar import grammar_cache
from prefixcache.engine.interleave import BetweenLayers
from prefixcache.engine.kv_layout import kv_layout
from prefixcache.engine.kv_store import KVStore, kv_dtype
from prefixcache.engine.logprobs import Logprob, fill_prompt_logprobs, token_logprobs
from prefixcache.engine.models import build_model
from prefixcache.engine.quant import weights_kernel
from prefixcache.engine.request import Branch, FinishReason, Request, RequestOutput
from prefixcache.engine.sampling import History, sample
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.engine.scheduler import Room, ScheduledChunk, Scheduler, step_shape
from prefixcache.engine.scrub import BlockScrubber
from prefixcache.engine.snapshot import EngineSnapshot, take_snapshot
from prefixcache.engine.stopping import (
    append_output,
    length_reason,
    stop_reason,
    stop_token_ids,
)
from prefixcache.engine.tier_link import TierLink, block_format
from prefixcache.engine.weight_types.linear import set_decode_activations
from prefixcache.engine.weights import LoadedModel
from prefixcache.protocol.tenant_secret import load_secrets
from prefixcache.tier import open_tier
from prefixcache.tier.client import QUEUE_BLOCKS
from prefixcache.tier.seal import TierKeys

log = logging.getLogger("prefixcache.engine")


@dataclass(slots=True)
class Sampled:
    """What one step's sampling produced: a token (and maybe its logprob) per branch, and
    the branches that asked for no token at all (``max_tokens=0``: prompt scored only)."""

    branches: list[Branch]
    tokens: list[int]
    logprobs: list[Logprob | None]
    scored: list[Branch]


@dataclass(slots=True)
class EngineConfig:
    """Engine knobs; ``num_kv_blocks`` wins over ``kv_cache_bytes`` when both are set."""

    block_size: int = DEFAULT_BLOCK_SIZE
    num_kv_blocks: int | None = None
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_model_len: int | None = None
    step_target_ms: float | None = None  # None: steps sized in tokens only; see config.py
    # With a step target: long prompts in steps of their own, urgent steps between their layers
    interleave_long_prompts: bool = True
    enable_prefix_caching: bool = True
    cache_aware_scheduling: bool = False
    eviction_policy: str = DEFAULT_POLICY
    index: str = DEFAULT_INDEX
    dtype: torch.dtype = torch.float32
    kv_cache_dtype: str | None = None  # the pool's K/V: float32, bfloat16, int8; None: dtype
    kv_layout: str = DEFAULT_KV_LAYOUT  # hybrid: window layers keep their window only; full
    quantized_weights: bool = True  # a GGUF's Q4 layers and Q8_0/Q4 output on int4 kernels
    fused_decode: bool = True  # one sequence's few new tokens in one native call (fused_decode.py)
    # the GGUF decode kernels' activations: int16 codes for one or two rows (kernels/gguf_int8.h),
    # "fp32" (exact), or "int8" codes as llama.cpp's
    decode_activations: str = DEFAULT_DECODE_ACTIVATIONS
    seed: int = 0
    zero_on_evict: bool = False  # zero every block's K/V before its slot is reused
    log_cache_keys: str | None = None  # JSONL file: one line per looked-up block/eviction
    kv_tier: str | None = None  # a second KV tier: "disk:PATH" or "redis://HOST:PORT/DB"
    kv_tier_max_bytes: int | None = None  # the disk tier's size cap (default 4 GiB)
    kv_tier_ttl_seconds: int | None = None  # a Redis tier's TTL per value (None: no expiry)
    kv_tier_max_wait: float = 0.5  # seconds a request may wait for its tier blocks, at most
    kv_tier_min_wait: float = 0.0  # ... and at least (a floor under the estimate)
    owner_shares: dict[str, float] | None = None  # fair cache: owner -> share ({}: equal)
    tier_keys: TierKeys | None = None  # sealing keys of tier values (None: per process)
    retention_budget: float = DEFAULT_SHARE  # of the pool, that one owner may retain
    retention_budgets: dict[str, float] | None = None  # owner -> its own retention share
    retention_clock: Callable[[], float] = time.monotonic  # retention expiries (tests: fake)


def modules(model: nn.Module) -> list[object]:
    """A model and its layers: where its projections are attributes."""
    return [model, *getattr(model, "layers", ())]


class LLMEngine:
    """The synchronous core: add requests, call ``step()`` until they finish."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.model_config = model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model, self.int4_weights = self._model(loaded, config)
        self.model.fused_weights = None  # its fused lists: built again on first use
        self.max_model_len = config.max_model_len or model_config.max_position_embeddings
        self.kv_dtype = kv_dtype(config.kv_cache_dtype) if config.kv_cache_dtype else config.dtype
        self.kv_cache_dtype = str(self.kv_dtype).removeprefix("torch.")  # its name
        self.layout = kv_layout(model_config, config.kv_layout)
        self.num_blocks = self._pool_pages(config)
        self.kv_store = KVStore.for_model(
            model_config, self.num_blocks, config.block_size, self.kv_dtype, self.layout
        )
        namespace = Namespace(
            model=model_config.name,
            revision=model_config.revision,
            dtype=str(config.dtype).removeprefix("torch."),
            block_size=config.block_size,
            extra=self._namespace_extra(),
        )
        self.manager = KVCacheManager(
            self.num_blocks,
            config.block_size,
            enable_caching=config.enable_prefix_caching,
            namespace=namespace,
            eviction_policy=config.eviction_policy,
            index=config.index,
            owner_shares=config.owner_shares,
            clock=config.retention_clock,
            retention_budget=config.retention_budget,
            retention_budgets=config.retention_budgets,
            groups=self.layout.groups,
        )
        self.tier = self._open_tier(config) if config.kv_tier else None
        self.scheduler = Scheduler(
            self.manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            cache_aware=config.cache_aware_scheduling,
            loader=self.tier,
            step_target=None if config.step_target_ms is None else config.step_target_ms / 1e3,
            interleave=config.interleave_long_prompts,
        )
        self.between = BetweenLayers()  # a driver's hooks into a long prompts' step
        self.requests: dict[str, Request] = {}
        self.num_constrained = 0  # requests with a grammar: none, and sampling masks nothing
        self.on_retired: list[Callable[[Request], None]] = []  # each finished or aborted one
        self._next_seed = config.seed
        self.seconds_per_token: float | None = None
        self.scrubber = BlockScrubber(self.manager, self.kv_store, config.zero_on_evict)
        self._key_log = self._open_key_log(config.log_cache_keys)
        self.snapshot: EngineSnapshot = take_snapshot(self)  # what other threads may read

    def publish_snapshot(self) -> None:
        """Replace ``snapshot`` by one assignment (on the thread that steps the engine)."""
        self.snapshot = take_snapshot(self)

    def _open_key_log(self, path: str | None) -> TextIO | None:
        """Attach the key-component log to the cache (debugging; never tokens or text)."""
        if path is None:
            return None
        log = open(path, "a", encoding="utf-8")  # noqa: SIM115 -- lives as long as the engine

        def write(text: str) -> None:  # whole lines, flushed: a crash loses nothing
            log.write(text)
            log.flush()

        self.manager.set_observer(KeyLogObserver(write, self.manager.root_digest))
        return log

    def _open_tier(self, config: EngineConfig) -> TierLink:
        """Connect the second KV tier (a store that is down now is retried later)."""
        options: dict[str, object] = {}
        if config.kv_tier_max_bytes is not None:
            options["max_bytes"] = config.kv_tier_max_bytes
        if config.kv_tier_ttl_seconds is not None and not config.kv_tier.startswith("disk:"):
            options["ttl_seconds"] = config.kv_tier_ttl_seconds
        options["queue_blocks"] = QUEUE_BLOCKS * self.layout.pages_per_block  # values
        client = open_tier(config.kv_tier, block_format(self.manager, self.kv_store), **options)
        keys = config.tier_keys or default_tier_keys(config.kv_tier)
        waits = (config.kv_tier_min_wait, config.kv_tier_max_wait)
        return TierLink(client, keys, self.manager, self.kv_store, *waits)

    def set_event_sink(self, sink: EventSink, token_ids: bool = False) -> None:
        """Report KV events to ``sink``: the pool's, and the tier's with its medium; stored
        blocks name the pool's KV dtype."""
        self.manager.set_event_sink(sink, token_ids=token_ids, kv_cache_dtype=self.kv_cache_dtype)
        if self.tier is not None:
            self.tier.report_events(sink)

    def close(self) -> None:
        """Release what the engine holds open (key log, tier writer); safe to call twice."""
        if self._key_log is not None:
            self._key_log.close()
            self._key_log = None
        if self.tier is not None:
            self.tier.close()
            self.tier = None
            self.scheduler.loader = None

    @staticmethod
    def _model(loaded: LoadedModel, config: EngineConfig) -> tuple[nn.Module, list[str]]:
        """The model to run and the HF names on int4 weights: built here (once per loaded
        model and form), or already built."""
        if loaded.model is not None:  # fp32 on int4 kernels (`engine/weight_cache.py`)
            if config.dtype != torch.float32 or not config.quantized_weights:
                raise ValueError("a prebuilt model runs fp32 on int4 weights only")
            set_decode_activations(modules(loaded.model), config.decode_activations)
            return loaded.model, list(loaded.int4_weights)
        form = (config.dtype, config.quantized_weights, config.decode_activations)
        if form not in loaded.built:
            model = build_model(loaded.config, dtype=config.dtype)
            if config.quantized_weights:
                loaded.built[form] = (
                    model,
                    model.load_quantized(loaded.state_dict, loaded.quantized),
                )
            else:
                model.load_weights(loaded.state_dict)
                loaded.built[form] = model, []
        model, int4_names = loaded.built[form]
        set_decode_activations(modules(model), config.decode_activations)
        return model, list(int4_names)

    def _namespace_extra(self) -> tuple[tuple[str, str], ...]:
        """What else changes the KV values: the kernel quantized weights run on ("int4" or
        "gguf") and its activations if not fp32, a KV dtype other than the model's (so digests
        stay as they were without one, and KV of another dtype is never looked up, in the tier
        or by a router), a hybrid layout (whose tier values are pages of some layers, and whose
        blocks may lack window pages)."""
        extra = [("weights", weights_kernel(self.model))] if self.int4_weights else []
        if self.int4_weights and self.config.decode_activations != DEFAULT_DECODE_ACTIVATIONS:
            extra.append(("decode_activations", self.config.decode_activations))
        if self.kv_dtype != self.config.dtype:
            extra.append(("kv_cache_dtype", self.kv_cache_dtype))
        if self.layout.groups:  # pages of some layers each: a tier value of another shape
            extra.append(("kv_layout", self.layout.name))
        return tuple(extra)

    def _pool_pages(self, config: EngineConfig) -> int:
        """Pages in the pool: ``num_kv_blocks`` blocks with every group holding them (the
        same blocks an all-full layout would fit), or what ``kv_cache_bytes`` holds."""
        if config.num_kv_blocks:
            return config.num_kv_blocks * self.layout.pages_per_block
        return self._blocks_for_bytes(config.kv_cache_bytes)

    def _blocks_for_bytes(self, budget: int) -> int:
        """How many KV pages fit in ``budget`` bytes (at the pool's KV dtype and layout)."""
        per_block = KVStore.bytes_per_block(
            self.layout.page_layers,
            self.config.block_size,
            self.model_config.num_kv_heads,
            self.model_config.head_dim,
            self.kv_dtype,
        )
        if budget < per_block:
            raise ValueError(f"kv_cache_bytes {budget} is below one block ({per_block} bytes)")
        return budget // per_block

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        min_hit_tokens: int = 0,
        zero_on_evict: bool = False,
        use_tier: bool = True,
        owner: str | None = None,
        previous_cache_salt: str | None = None,
        retention: tuple[Keep, ...] = (),
        cache_key: str | None = None,
        priority: int = 0,
    ) -> Request:
        """Queue a request; ValueError (naming the limit) if it can never be served.

        A cache hit shorter than ``min_hit_tokens`` counts as a miss; with ``zero_on_evict``
        the request's blocks are zeroed before their slots are reused; with ``use_tier``
        off it neither reads nor writes the second KV tier. ``owner`` (a tenant) is whose
        cache share its blocks count against; ``previous_cache_salt`` (a tenant secret's
        rotation) is its salt under the previous secret, whose tier values it may still read.
        ``retention`` lists prompt prefixes to keep cached once computed (see ``Keep``); each
        is held against ``owner``'s retention budget. ``cache_key`` (an opaque per-tenant id)
        is for traces and logs only: it changes nothing the engine does. ``priority``: a
        lower number is scheduled first and may pause a running prefill of a higher one.
        A request that asks for prompt logprobs
        computes its whole prompt (a cached prefix has no logits): its own hit is skipped and
        the tier is not used, while the blocks it computes are shared as usual.
        """
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        params = params or SamplingParams()
        self._check_prompt(prompt_token_ids)
        self._check_token_ids(params)
        if params.prompt_logprobs is not None:
            min_hit_tokens = max(min_hit_tokens, len(prompt_token_ids))
            use_tier = False
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an int, got {priority!r}")
        if not isinstance(min_hit_tokens, int) or min_hit_tokens < 0:
            raise ValueError(f"min_hit_tokens must be an int >= 0, got {min_hit_tokens!r}")
        new_grammar = self._grammar_factory(params)
        if zero_on_evict:
            self.scrubber.activate()
        self._next_seed += 1
        request = Request(
            request_id,
            list(prompt_token_ids),
            params,
            cache_salt,
            seed=self._next_seed * 1_000_003,
            min_hit_tokens=min_hit_tokens,
            zero_on_evict=zero_on_evict,
            new_decoder=self.tokenizer.incremental_decoder,
            use_tier=use_tier,
            owner=owner,
            previous_cache_salt=previous_cache_salt,
            retention=check_keeps(retention, len(prompt_token_ids)),
            cache_key=cache_key,
            new_grammar=new_grammar,
            priority=priority,
        )
        if self.tier is not None:
            self.tier.prefetch(request)
        self.scheduler.add(request.branches[0])
        self.requests[request_id] = request
        self.num_constrained += params.constraint is not None
        return request

    def _check_prompt(self, prompt: list[int]) -> None:
        """Reject at once what could never run: bad ids, too long for context or pool."""
        if not prompt:
            raise ValueError("the prompt is empty: at least 1 token is needed")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad!r} is outside the vocabulary [0, {vocab})")
        if len(prompt) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt)} tokens; the model's context is "
                f"{self.max_model_len} tokens (including at least 1 generated)"
            )
        check_fits(
            len(prompt),
            self.config.block_size,
            self.num_blocks,
            num_generated=1,
            pages=self.layout.pages_per_block,
        )

    def _grammar_factory(self, params: SamplingParams) -> Callable[[], GrammarState] | None:
        """Fresh matchers of the request's constraint (compiled now: ValueError if it can't)."""
        constraint = params.constraint
        if constraint is None:
            return None
        cache = grammar_cache(self.tokenizer)
        cache.compile(constraint)
        return lambda: GrammarState(cache.matcher(constraint))

    def _check_token_ids(self, params: SamplingParams) -> None:
        """Token ids in ``logit_bias`` must be in the vocabulary."""
        vocab = self.model_config.vocab_size
        bad = next((t for t in params.logit_bias if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"logit_bias token id {bad} is outside the vocabulary [0, {vocab})")

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; None if it is not in the engine."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for branch in request.branches:
            if not branch.finished:
                branch.output.finish_reason = FinishReason.ABORT
            self.scheduler.finish(branch)
        self._retire(request)
        return request.snapshot()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def uncached_tokens(self, request_id: str) -> int:
        """The prompt tokens of a request just added that its prefix hit in the pool would
        not cover now (what it would compute, unless the tier holds them)."""
        request = self.requests[request_id]
        return len(request.prompt_token_ids) - self.scheduler.cached_tokens(request.branches[0])

    # ---------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """One batch: schedule, forward, sample, postprocess; the requests that advanced."""
        chunks = self.scheduler.schedule()
        if not chunks:
            if self.tier is not None:  # requests may be waiting for their tier blocks
                self.tier.wait_for_fetches(self.scheduler.waiting)
            return []
        if self.scheduler.in_flight:
            return self._long_step(chunks)
        return self._run(chunks)

    def _run(self, chunks: list[ScheduledChunk]) -> list[RequestOutput]:
        self._before_forward(chunks)
        logits = self._forward(chunks)
        return self._postprocess(self._sample(chunks, logits))

    def _long_step(self, chunks: list[ScheduledChunk]) -> list[RequestOutput]:
        """Long prompts' step: the urgent steps due run before it and between its layers
        (``_interleave``); their outputs go out at once, or come first in the result."""
        self._before_forward(chunks)
        try:
            self._interleave()
            logits = self._forward(chunks, self._interleave)
        finally:
            self.scheduler.land()
        outputs = self._postprocess(self._sample(chunks, logits))
        return self.between.release() + outputs

    def _interleave(self) -> None:
        """Take the requests that arrived; run the urgent step that is due, if any."""
        started = time.perf_counter()
        self.between.take_arrivals()
        if self.scheduler.urgent_due():
            chunks = self.scheduler.schedule_urgent()
            if chunks:
                self.between.deliver(self._run(chunks))
        self.between.seconds += time.perf_counter() - started

    def _before_forward(self, chunks: list[ScheduledChunk]) -> None:
        """Per-request milestones, and zeroing of reused slots before the forward writes."""
        now = time.perf_counter()
        for chunk in chunks:
            request = chunk.branch.request
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
            if chunk.start < request.prompt_length:
                prefill = min(chunk.num_tokens, request.prompt_length - chunk.start)
                request.metrics.num_prefill_tokens += prefill
        self.scrubber.zero_reused()
        self.scrubber.track(chunks)

    def _forward(
        self, chunks: list[ScheduledChunk], between_layers: Callable[[], None] | None = None
    ) -> torch.Tensor | None:
        """One forward over every scheduled token; logits only where a token is sampled.
        ``between_layers`` runs between the layers of an eager forward."""
        windows = self.manager.windows
        batch = ForwardBatch.build(
            chunks, self.config.block_size, () if windows is None else windows.windows
        )
        between, started = self.between.seconds, time.perf_counter()
        try:
            with torch.inference_mode():
                hidden = self.model(
                    batch.input_ids,
                    batch.positions,
                    batch.metadata,
                    self.kv_store,
                    fused=self.config.fused_decode,
                    between_layers=between_layers,
                )
                logits = (
                    self.model.compute_logits(hidden[batch.logit_rows]) if batch.sampled else None
                )
                self._score_prompts(chunks, hidden)
        except Exception:
            self._drop_failed_step()
            raise
        elapsed = time.perf_counter() - started - (self.between.seconds - between)
        self._track_speed(batch.num_tokens, elapsed)
        self.scheduler.observe_step(elapsed, step_shape(chunks))  # the cost model learns it
        if self.tier is not None:  # their KV is computed now: copy it out for the tier
            self.tier.write_computed(chunks)
        return logits

    def _score_prompts(self, chunks: list[ScheduledChunk], hidden: torch.Tensor) -> None:
        """Prompt logprobs for the prompt positions of chunks whose request asks for them."""
        offset = 0
        for chunk in chunks:
            request = chunk.branch.request
            if request.prompt_logprobs is not None and chunk.start < request.prompt_length - 1:
                fill_prompt_logprobs(
                    request.prompt_logprobs,
                    request.prompt_token_ids,
                    hidden[offset : offset + chunk.num_tokens],
                    chunk.start,
                    self.model.compute_logits,
                    request.params.prompt_logprobs or 0,
                )
            offset += chunk.num_tokens

    def _sample(self, chunks: list[ScheduledChunk], logits: torch.Tensor | None) -> Sampled:
        """One token for every branch that reached its last token (forking ``n > 1`` first)."""
        rows, branches, scored = [], [], []
        for row, chunk in enumerate(c for c in chunks if c.needs_logits):
            if chunk.branch.request.params.max_tokens == 0:
                scored.append(chunk.branch)
                continue
            group = [chunk.branch] + self._new_forks(chunk.branch)
            branches += group
            rows += [row] * len(group)
        if not branches:
            return Sampled([], [], [], scored)
        assert logits is not None
        if rows != list(range(len(logits))):  # a row per branch (n > 1), or fewer
            logits = logits[torch.tensor(rows)]
        params = [b.request.params for b in branches]
        histories = [self._history(b) for b in branches]
        masks = (
            allowed_masks(branches, self.tokenizer.vocab_size, self.tokenizer.eos_token_ids)
            if self.num_constrained
            else None
        )
        tokens = sample(logits, params, [b.generator for b in branches], histories, masks)
        return Sampled(branches, tokens, self._logprobs(logits, branches, tokens), scored)

    def _history(self, branch: Branch) -> History:
        """The tokens a branch's logit processors look at."""
        return History(
            branch.request.prompt_token_ids,
            branch.output.token_ids,
            stop_token_ids(branch, self.tokenizer.eos_token_ids),
        )

    def _logprobs(
        self, logits: torch.Tensor, branches: list[Branch], tokens: list[int]
    ) -> list[Logprob | None]:
        """The sampled tokens' logprobs (raw logits), for the branches that ask.

        Raw: before logit processors and before a grammar's mask (as vLLM's default).
        """
        wanted = [i for i, b in enumerate(branches) if b.request.params.logprobs is not None]
        found: list[Logprob | None] = [None] * len(branches)
        if wanted:
            ks = [branches[i].request.params.logprobs or 0 for i in wanted]
            rows = logits[torch.tensor(wanted)]
            entries = token_logprobs(rows, [tokens[i] for i in wanted], ks)
            for i, entry in zip(wanted, entries, strict=True):
                found[i] = entry
        return found

    def _new_forks(self, parent: Branch) -> list[Branch]:
        """At the first token of an ``n > 1`` request: branches 1..n-1, sharing its blocks."""
        request = parent.request
        if parent.index != 0 or request.params.n <= len(request.branches):
            return []
        children = request.fork_branches()
        self.scheduler.add_forks(parent, children)
        return children

    def _postprocess(self, sampled: Sampled) -> list[RequestOutput]:
        """Record each token, finish or grow its branch; snapshots of the touched requests."""
        touched: dict[str, Request] = {}
        now = time.perf_counter()
        for branch, token, logprob in zip(
            sampled.branches, sampled.tokens, sampled.logprobs, strict=True
        ):
            request = branch.request
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            self._accept_token(branch, token, logprob)
            touched[request.request_id] = request
        for branch in sampled.scored:
            branch.request.metrics.first_token_time = now
            self._finish_scored(branch)
            touched[branch.request.request_id] = branch.request
        self.scrubber.zero_reused()  # appends may have reused slots, copy targets too
        self.kv_store.copy_blocks(self.manager.pop_pending_copies())
        return [request.snapshot() for request in touched.values()]

    def _track_speed(self, num_tokens: int, seconds: float) -> None:
        """A moving average of forward seconds per token (to estimate prefill time saved)."""
        if num_tokens >= 64:  # small decode batches say little about prefill speed
            rate = seconds / num_tokens
            previous = self.seconds_per_token
            self.seconds_per_token = rate if previous is None else 0.8 * previous + 0.2 * rate
            if self.tier is not None:
                self.tier.seconds_per_token = self.seconds_per_token

    def _drop_failed_step(self) -> None:
        """A forward failed: its committed blocks hold no KV. Abort all, forget the cache."""
        self.scheduler.land()  # an urgent step failed between a long step's layers
        self.between.release()  # its held outputs: of requests aborted now
        for request_id in list(self.requests):
            self.abort_request(request_id)
        self.manager.reset()

    def _accept_token(self, branch: Branch, token: int, logprob: Logprob | None = None) -> None:
        """Record a sampled token; finish the branch or give it room for the next one."""
        reason = stop_reason(branch, token, self.tokenizer.eos_token_ids)
        if reason is None:  # a stop token is not part of the output
            if append_output(branch, token, logprob):
                self._finish_branch(branch, FinishReason.STOP, flush=False)
                return
            if advance(branch):  # the grammar is complete: nothing but EOS may follow
                reason = FinishReason.STOP
            else:
                reason = length_reason(branch, self.max_model_len)
        if reason is not None:
            self._finish_branch(branch, reason)
        elif branch.seq is not None and self.scheduler.append_token(branch, token) is Room.NONE:
            self._finish_branch(branch, FinishReason.LENGTH)

    def _finish_scored(self, branch: Branch) -> None:
        """A ``max_tokens=0`` request after its prefill: every completion ends empty."""
        for output in branch.request.outputs:
            output.finish_reason = FinishReason.LENGTH
        self.scheduler.finish(branch)
        self.requests.pop(branch.request.request_id, None)
        self._retire(branch.request)

    def _finish_branch(self, branch: Branch, reason: FinishReason, flush: bool = True) -> None:
        """Mark a completion done, free its blocks, and retire the request when all are."""
        if flush:
            branch.output.text += branch.decoder.flush()
        branch.output.finish_reason = reason
        self.scheduler.finish(branch)
        request = branch.request
        if request.finished and request.params.n == len(request.branches):
            self.requests.pop(request.request_id, None)
            self._retire(request)

    def _retire(self, request: Request) -> None:
        """A request left the engine: stamp it and tell whoever listens (trace-out)."""
        request.metrics.finished_time = time.perf_counter()
        self.num_constrained -= request.params.constraint is not None
        for hook in self.on_retired:
            hook(request)


def default_tier_keys(spec: str) -> TierKeys:
    """Keys when none are given: a disk tier keeps its secret beside it (as ``serve`` does),
    so a restart opens its own values; any other tier gets keys of this process only."""
    if spec.startswith("disk:"):
        return TierKeys(*load_secrets(Path(spec.removeprefix("disk:")) / "tenant-secret"))
    log.warning(
        "KV tier values are sealed with a key of this process only: no other process opens "
        "them (give the engine tier_keys, the server --tenant-secret-file)"
    )
    return TierKeys.ephemeral()
