"""LLMEngine: one step = schedule, one forward over the whole batch, sample, account."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TextIO

import torch

from prefixcache.cache import CapacityError, KVCacheManager, Namespace
from prefixcache.cache.manager import cdiv
from prefixcache.cache.observer import KeyLogObserver
from prefixcache.engine.attention import AttentionMetadata
from prefixcache.engine.kv_store import KVStore
from prefixcache.engine.model import LlamaModel
from prefixcache.engine.request import Branch, FinishReason, Request, RequestOutput
from prefixcache.engine.sampling import SamplingParams, sample
from prefixcache.engine.scheduler import ScheduledChunk, Scheduler
from prefixcache.engine.scrub import BlockScrubber
from prefixcache.engine.weights import LoadedModel

DEFAULT_KV_CACHE_BYTES = 2 * 2**30


@dataclass(slots=True)
class EngineConfig:
    """Engine knobs; ``num_kv_blocks`` wins over ``kv_cache_bytes`` when both are set."""

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    cache_aware_scheduling: bool = False
    eviction_policy: str = "lru"
    index: str = "hash"
    dtype: torch.dtype = torch.float32
    seed: int = 0
    zero_on_evict: bool = False  # zero every block's K/V before its slot is reused
    log_cache_keys: str | None = None  # JSONL file: one line per looked-up block/eviction


class LLMEngine:
    """The synchronous core: add requests, call ``step()`` until they finish."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.model_config = model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model = LlamaModel(model_config, dtype=config.dtype)
        self.model.load_weights(loaded.state_dict)
        self.max_model_len = config.max_model_len or model_config.max_position_embeddings
        self.num_blocks = config.num_kv_blocks or self._blocks_for_bytes(config.kv_cache_bytes)
        self.kv_store = KVStore(
            model_config.num_layers,
            self.num_blocks,
            config.block_size,
            model_config.num_kv_heads,
            model_config.head_dim,
            dtype=config.dtype,
        )
        namespace = Namespace(
            model=model_config.name,
            revision=model_config.revision,
            dtype=str(config.dtype).removeprefix("torch."),
            block_size=config.block_size,
        )
        self.cache = KVCacheManager(
            self.num_blocks,
            config.block_size,
            enable_caching=config.enable_prefix_caching,
            namespace=namespace,
            eviction_policy=config.eviction_policy,
            index=config.index,
        )
        self.scheduler = Scheduler(
            self.cache,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            cache_aware=config.cache_aware_scheduling,
        )
        self.requests: dict[str, Request] = {}
        self._next_seed = config.seed
        self.seconds_per_token: float | None = None
        self.scrubber = BlockScrubber(self.cache, self.kv_store, config.zero_on_evict)
        self._key_log = self._open_key_log(config.log_cache_keys)

    def _open_key_log(self, path: str | None) -> TextIO | None:
        """Attach the key-component log to the cache (debugging; never tokens or text)."""
        if path is None:
            return None
        log = open(path, "a", encoding="utf-8")  # noqa: SIM115 -- lives as long as the engine

        def write(text: str) -> None:  # whole lines, flushed: a crash loses nothing
            log.write(text)
            log.flush()

        self.cache.set_observer(KeyLogObserver(write, self.cache.root_digest))
        return log

    def _blocks_for_bytes(self, budget: int) -> int:
        """How many KV blocks fit in ``budget`` bytes."""
        per_block = KVStore.bytes_per_block(
            self.model_config.num_layers,
            self.config.block_size,
            self.model_config.num_kv_heads,
            self.model_config.head_dim,
            self.config.dtype,
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
        sensitive: bool = False,
    ) -> Request:
        """Queue a request; ValueError (naming the limit) if it can never be served.

        A cache hit shorter than ``min_hit_tokens`` counts as a miss; a ``sensitive``
        request's blocks are zeroed before their slots are reused.
        """
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        params = params or SamplingParams()
        self._check_prompt(prompt_token_ids)
        if not isinstance(min_hit_tokens, int) or min_hit_tokens < 0:
            raise ValueError(f"min_hit_tokens must be an int >= 0, got {min_hit_tokens!r}")
        if sensitive:
            self.scrubber.activate()
        self._next_seed += 1
        request = Request(
            request_id,
            list(prompt_token_ids),
            params,
            cache_salt,
            seed=self._next_seed * 1_000_003,
            min_hit_tokens=min_hit_tokens,
            sensitive=sensitive,
        )
        for branch in request.branches:
            branch.decoder = self.tokenizer.incremental_decoder()
            self.scheduler.add(branch)
        self.requests[request_id] = request
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
        blocks = cdiv(len(prompt) + 1, self.config.block_size)
        if blocks > self.num_blocks:
            raise CapacityError(
                f"the prompt has {len(prompt)} tokens and needs {blocks} KV blocks; the "
                f"pool has {self.num_blocks} blocks ({self.num_blocks * self.config.block_size}"
                f" tokens)"
            )

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; None if it is not in the engine."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for branch in request.branches:
            if not branch.finished:
                branch.output.finish_reason = FinishReason.ABORT
            self.scheduler.finish(branch)
        request.metrics.finished_time = time.perf_counter()
        return request.snapshot()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one batch; return the requests that advanced, as snapshots."""
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
        now = time.perf_counter()
        for chunk in chunks:
            metrics = chunk.branch.request.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
            if chunk.start < chunk.branch.request.prompt_length:
                metrics.num_prefill_tokens += min(
                    chunk.num_tokens, chunk.branch.request.prompt_length - chunk.start
                )
        sampled = [chunk for chunk in chunks if chunk.needs_logits]
        self.scrubber.zero_reused()  # before this forward writes into reused slots
        self.scrubber.track(chunks)
        started = time.perf_counter()
        try:
            logits = self._forward(chunks, sampled)
        except Exception:
            self._drop_failed_step()
            raise
        self._track_speed(sum(c.num_tokens for c in chunks), time.perf_counter() - started)
        touched = self._accept_all(sampled, logits)
        self.scrubber.zero_reused()  # appends may have reused slots, copy targets too
        self.kv_store.copy_blocks(self.cache.pop_pending_copies())
        return [request.snapshot() for request in touched]

    def _track_speed(self, num_tokens: int, seconds: float) -> None:
        """A moving average of forward seconds per token (to estimate prefill time saved)."""
        if num_tokens >= 64:  # small decode batches say little about prefill speed
            rate = seconds / num_tokens
            previous = self.seconds_per_token
            self.seconds_per_token = rate if previous is None else 0.8 * previous + 0.2 * rate

    def _drop_failed_step(self) -> None:
        """A forward failed: its committed blocks hold no KV. Abort all, forget the cache."""
        for request_id in list(self.requests):
            self.abort_request(request_id)
        self.cache.reset()

    def _forward(self, chunks: list[ScheduledChunk], sampled: list[ScheduledChunk]):
        """One forward over every scheduled token; logits only where a token is sampled."""
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens, context_lens, tables, ends = [], [], [], []
        for chunk in chunks:
            seq = chunk.branch.seq
            end = chunk.start + chunk.num_tokens
            input_ids += seq.token_ids[chunk.start : end]
            positions += range(chunk.start, end)
            query_lens.append(chunk.num_tokens)
            context_lens.append(end)
            tables.append(seq.block_table)
            if chunk.needs_logits:
                ends.append(len(input_ids) - 1)
        metadata = AttentionMetadata.build(query_lens, context_lens, tables, self.config.block_size)
        with torch.inference_mode():
            hidden = self.model(
                torch.tensor(input_ids), torch.tensor(positions), metadata, self.kv_store
            )
            return self.model.compute_logits(hidden[torch.tensor(ends)]) if sampled else None

    def _accept_all(self, sampled: list[ScheduledChunk], logits) -> list[Request]:
        """Sample every branch that reached its last token; fork ``n > 1`` requests."""
        touched: dict[str, Request] = {}
        rows, branches = [], []
        for row, chunk in enumerate(sampled):
            branch = chunk.branch
            branches.append(branch)
            rows.append(row)
            if branch.index == 0 and branch.request.params.n > len(branch.request.branches):
                for child in self._fork_children(branch):
                    branches.append(child)
                    rows.append(row)
        if not branches:
            return []
        params = [b.request.params for b in branches]
        tokens = sample(logits[torch.tensor(rows)], params, [b.generator for b in branches])
        now = time.perf_counter()
        for branch, token in zip(branches, tokens, strict=True):
            request = branch.request
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            self._accept_token(branch, token)
            touched[request.request_id] = request
        return list(touched.values())

    def _fork_children(self, parent: Branch) -> list[Branch]:
        """Branches 1..n-1 share the parent's prompt blocks (copy-on-write tail)."""
        request = parent.request
        children = []
        for index in range(1, request.params.n):
            child = Branch(request, index)
            child.decoder = self.tokenizer.incremental_decoder()
            child.seq = self.cache.fork(parent.seq, child.id)
            request.branches.append(child)
            self.scheduler.running.append(child)
            children.append(child)
        return children

    def _accept_token(self, branch: Branch, token: int) -> None:
        """Record a sampled token; finish the branch or give it room for the next one."""
        reason = self._stop_reason(branch, token)
        if reason is None:  # a stop token is not part of the output
            branch.output.token_ids.append(token)
            new_text = branch.decoder.push(token)
            branch.output.text += new_text
            if self._cut_at_stop_string(branch.output, len(new_text), branch.request.params):
                self._finish_branch(branch, FinishReason.STOP, flush=False)
                return
            reason = self._length_reason(branch)
        if reason is not None:
            self._finish_branch(branch, reason)
        elif branch.seq is not None:
            self._append_or_preempt(branch, token)

    def _stop_reason(self, branch: Branch, token: int) -> FinishReason | None:
        params = branch.request.params
        if token in params.stop_token_ids:
            return FinishReason.STOP
        if not params.ignore_eos and token in self.tokenizer.eos_token_ids:
            return FinishReason.STOP
        return None

    @staticmethod
    def _cut_at_stop_string(output, new_chars: int, params: SamplingParams) -> bool:
        """Truncate the text before the first stop string that the new text completed."""
        for stop in params.stop:
            cut = output.text.find(stop, max(0, len(output.text) - new_chars - len(stop) + 1))
            if cut != -1:
                output.text = output.text[:cut]
                return True
        return False

    def _length_reason(self, branch: Branch) -> FinishReason | None:
        """LENGTH once max_tokens or the model's context is reached."""
        request = branch.request
        generated = len(branch.output.token_ids)
        if generated >= request.params.max_tokens:
            return FinishReason.LENGTH
        if request.prompt_length + generated >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish_branch(self, branch: Branch, reason: FinishReason, flush: bool = True) -> None:
        """Mark a completion done, free its blocks, and retire the request when all are."""
        if flush:
            branch.output.text += branch.decoder.flush()
        branch.output.finish_reason = reason
        self.scheduler.finish(branch)
        request = branch.request
        if request.finished and request.params.n == len(request.branches):
            request.metrics.finished_time = time.perf_counter()
            self.requests.pop(request.request_id, None)

    def _append_or_preempt(self, branch: Branch, token: int) -> None:
        """Make room for the new token, preempting the newest running branches if needed."""
        while not self.cache.append(branch.seq, [token]):
            victim = self.scheduler.preempt_last()
            if victim is branch:
                if not self.scheduler.running:  # alone and still no room: it cannot grow
                    self.scheduler.waiting.remove(branch)
                    self._finish_branch(branch, FinishReason.LENGTH)
                return
