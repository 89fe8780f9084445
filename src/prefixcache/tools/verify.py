"""``prefixcache verify``: a workload with caching on and off must produce the same tokens.

The article's first debugging step, as a command: run the same requests (same seeds)
through two engines that differ only in prefix caching, and diff every generated token.
float64 by default, so a different batch shape cannot flip a greedy choice: any
difference is a cache bug, not rounding. ``--tiny-pool`` sizes the KV pool just above the
largest request, which forces eviction and preemption; both pools must end all free,
with ``check_invariants()`` passing.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field

from prefixcache.cache.common import DEFAULT_BLOCK_SIZE
from prefixcache.model_names import MODEL_HELP
from prefixcache.tools.request_file import InputError

DTYPES = ("float64", "float32")


@dataclass(slots=True)
class VerifyOptions:
    """How to build the two engines."""

    block_size: int = DEFAULT_BLOCK_SIZE
    tiny_pool: bool = False
    dtype: str = "float64"
    zero_on_evict: bool = False


@dataclass(slots=True)
class RunResult:
    """What one pass produced: tokens per request and completion, and cache accounting."""

    outputs: dict[str, list[list[int]]] = field(default_factory=dict)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    evictions: int = 0
    preemptions: int = 0
    pool_problem: str | None = None


def add_verify_parser(commands: argparse._SubParsersAction) -> None:
    """The ``verify`` subcommand and its options."""
    parser = commands.add_parser(
        "verify", help="run a workload with caching on and off; the tokens must be identical"
    )
    parser.add_argument("--model", help=MODEL_HELP)
    parser.add_argument("--workload", help="JSONL requests (default: a built-in mix)")
    parser.add_argument("--requests", type=int, default=12, help="built-in workload size")
    parser.add_argument("--max-tokens", type=int, default=8, help="built-in: most per request")
    parser.add_argument("--seed", type=int, default=0, help="built-in workload seed")
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    parser.add_argument("--dtype", choices=DTYPES, default="float64")
    parser.add_argument(
        "--tiny-pool", action="store_true", help="a pool just above the largest request"
    )
    parser.add_argument(
        "--zero-on-evict", action="store_true", help="zero reused blocks in the cached run"
    )


def run_verify(args: argparse.Namespace) -> int:
    """Load the model and the workload, verify, print; 0 identical, 1 not, 2 bad input."""
    from prefixcache.engine.weights import load_model
    from prefixcache.tools.workload import builtin_workload, load_workload

    if min(args.requests, args.max_tokens, args.block_size) < 1:
        print(
            "prefixcache verify: --requests, --max-tokens, --block-size must be >= 1",
            file=sys.stderr,
        )
        return 2
    try:
        loaded = load_model(args.model)
        if args.workload:
            workload = load_workload(args.workload, loaded.tokenizer)
        else:
            vocab = loaded.config.vocab_size
            workload = builtin_workload(vocab, args.requests, args.max_tokens, args.seed)
    except (InputError, ValueError) as error:
        print(f"prefixcache verify: {error}", file=sys.stderr)
        return 2
    options = VerifyOptions(args.block_size, args.tiny_pool, args.dtype, args.zero_on_evict)
    status, lines = verify(loaded, workload, options)
    print("\n".join(lines))
    return status


def verify(loaded, workload, options: VerifyOptions) -> tuple[int, list[str]]:
    """Both passes and the diff: (exit status, report lines)."""
    num_blocks = pool_size(workload, options)
    try:
        cached = run_pass(make_engine(loaded, True, num_blocks, options), workload)
        plain = run_pass(make_engine(loaded, False, num_blocks, options), workload)
    except ValueError as error:  # a request the engine refuses (vocabulary, context)
        return 2, [f"prefixcache verify: {error}"]
    lines = _summary(workload, cached, plain, num_blocks, options)
    mismatch = first_mismatch(workload, cached, plain)
    runs = {"cached": cached, "uncached": plain}
    problems = [
        f"pool not clean after the {name} run: {run.pool_problem}"
        for name, run in runs.items()
        if run.pool_problem
    ]
    if mismatch is None and not problems:
        compared = sum(len(tokens) for outs in cached.outputs.values() for tokens in outs)
        lines.append(f"  compared {compared} generated tokens: identical")
        lines.append(f"  both pools clean: all {num_blocks} blocks free, invariants hold")
        return 0, lines
    return 1, lines + ([f"MISMATCH {mismatch}"] if mismatch else []) + problems


def pool_size(workload, options: VerifyOptions) -> int:
    """Tiny: room for the largest single completion. Otherwise room for everything at once.

    A tiny pool still fits any one branch whole, so nothing is cut short for lack of room
    (which would differ between the runs); everything else must wait, be evicted or be
    preempted.
    """
    from prefixcache.tools.workload import footprint

    items = {item.request_id: item for round_ in workload for item in round_}
    needs = {name: footprint(item, items, options.block_size) for name, item in items.items()}
    if options.tiny_pool:
        return max(needs.values())
    return sum(needs[name] * items[name].params.n for name in items)


def make_engine(loaded, caching: bool, num_blocks: int, options: VerifyOptions):
    """One of the two engines (tests wrap this to inject a fault into the cached one)."""
    import torch

    from prefixcache.engine.engine import EngineConfig, LLMEngine

    config = EngineConfig(
        block_size=options.block_size,
        num_kv_blocks=num_blocks,
        enable_prefix_caching=caching,
        dtype=getattr(torch, options.dtype),
        zero_on_evict=options.zero_on_evict and caching,
    )
    return LLMEngine(loaded, config)


def run_pass(engine, workload) -> RunResult:
    """Every round to completion, in order; then check the pool is clean."""
    result = RunResult()
    prompts: dict[str, list[int]] = {}
    for round_ in workload:
        for item in round_:
            prompt = list(item.token_ids)
            if item.continues is not None:
                parent = item.continues
                prompt = prompts[parent] + result.outputs[parent][0] + prompt
            prompts[item.request_id] = prompt
            engine.add_request(item.request_id, prompt, item.params, cache_salt=item.cache_salt)
        for output in _run_to_completion(engine):
            result.outputs[output.request_id] = [o.token_ids for o in output.outputs]
            result.prompt_tokens += len(output.prompt_token_ids)
            result.cached_tokens += output.num_cached_tokens
    result.evictions = engine.manager.stats.evictions
    result.preemptions = engine.scheduler.num_preemptions
    result.pool_problem = pool_problem(engine)
    return result


def _run_to_completion(engine) -> list:
    finished = []
    while engine.has_unfinished_requests():
        finished += [output for output in engine.step() if output.finished]
    return finished


def pool_problem(engine) -> str | None:
    """None if no request is left, every block is free and the invariants hold."""
    cache = engine.manager
    if engine.requests or cache.num_free_blocks != cache.num_blocks:
        return f"{cache.num_blocks - cache.num_free_blocks} blocks still held"
    try:
        cache.check_invariants()
    except AssertionError as error:
        return f"check_invariants: {error}"
    return None


def first_mismatch(workload, cached: RunResult, plain: RunResult) -> str | None:
    """The first request (in workload order) whose tokens differ, and where."""
    for round_ in workload:
        for item in round_:
            ours, theirs = cached.outputs[item.request_id], plain.outputs[item.request_id]
            for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
                where = _first_difference(a, b)
                if where is not None:
                    return f"request {item.request_id} completion {index} {where}"
    return None


def _first_difference(ours: list[int], theirs: list[int]) -> str | None:
    """Where two token lists part: the position and both ids, or their lengths."""
    for position, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a != b:
            return f"output position {position}: cached {a}, uncached {b}"
    if len(ours) != len(theirs):
        return f"length: cached {len(ours)} tokens, uncached {len(theirs)}"
    return None


def _summary(workload, cached: RunResult, plain: RunResult, num_blocks: int, options) -> list[str]:
    requests = sum(len(round_) for round_ in workload)
    completions = sum(len(outs) for outs in cached.outputs.values())
    share = cached.cached_tokens / cached.prompt_tokens if cached.prompt_tokens else 0.0
    pool = "tiny pool" if options.tiny_pool else "roomy pool"
    return [
        f"verify: {requests} requests ({completions} completions) in {len(workload)} rounds; "
        f"{options.dtype}, block size {options.block_size}, {num_blocks} KV blocks ({pool})",
        f"  cached run:   {cached.cached_tokens} of {cached.prompt_tokens} prompt tokens from "
        f"cache ({share:.1%}); {cached.evictions} evictions, {cached.preemptions} preemptions",
        f"  uncached run: {plain.cached_tokens} prompt tokens from cache; "
        f"{plain.evictions} evictions, {plain.preemptions} preemptions",
    ]
