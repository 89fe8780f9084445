"""``prefixcache serve``: load the model, build the engine, run uvicorn."""

from __future__ import annotations

import argparse
import logging
import sys

from prefixcache.argtypes import positive_int
from prefixcache.cache.common import DEFAULT_BLOCK_SIZE
from prefixcache.cache.index import DEFAULT_INDEX, INDEX_NAMES
from prefixcache.cache.policy import DEFAULT_POLICY, POLICY_NAMES
from prefixcache.engine.config import (
    DEFAULT_KV_CACHE_BYTES,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
)
from prefixcache.server.limits import DEFAULT_MAX_PENDING


def add_serve_parser(commands: argparse._SubParsersAction) -> None:
    """The ``serve`` subcommand and its options."""
    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("--model", help="GGUF file or HF folder (default: SmolLM2-135M)")
    serve.add_argument("--served-model-name", help="name clients send (default: file name)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    size = serve.add_mutually_exclusive_group()
    size.add_argument("--kv-cache-blocks", type=positive_int, help="KV pool size in blocks")
    size.add_argument(
        "--kv-cache-bytes",
        type=positive_int,
        default=DEFAULT_KV_CACHE_BYTES,
        help=f"KV pool size in bytes (default {DEFAULT_KV_CACHE_BYTES / 2**30:g} GiB)",
    )
    serve.add_argument("--block-size", type=positive_int, default=DEFAULT_BLOCK_SIZE)
    serve.add_argument("--max-num-seqs", type=positive_int, default=DEFAULT_MAX_NUM_SEQS)
    serve.add_argument(
        "--max-num-batched-tokens", type=positive_int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS
    )
    serve.add_argument(
        "--max-pending",
        type=positive_int,
        default=DEFAULT_MAX_PENDING,
        help="requests in flight before new ones get HTTP 429",
    )
    serve.add_argument("--api-key-file", help="JSON file of tenants and their API keys")
    serve.add_argument("--no-prefix-caching", action="store_true")
    serve.add_argument("--cache-aware-scheduling", action="store_true")
    serve.add_argument("--eviction-policy", default=DEFAULT_POLICY, choices=POLICY_NAMES)
    serve.add_argument("--index", default=DEFAULT_INDEX, choices=INDEX_NAMES)
    serve.add_argument(
        "--log-cache-keys",
        metavar="PATH",
        help="append one JSON line per looked-up block and per eviction (digests, never tokens)",
    )
    serve.add_argument(
        "--zero-on-evict",
        action="store_true",
        help='zero every block\'s K/V before its slot is reused (per tenant: "zero_on_evict")',
    )


def run_serve(args: argparse.Namespace) -> int:
    """Build everything, say how it is set up, and serve until interrupted."""
    import uvicorn

    from prefixcache.engine.engine import EngineConfig, LLMEngine
    from prefixcache.engine.weights import load_model
    from prefixcache.server.app import create_app, started_banner
    from prefixcache.server.auth import Tenants

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        tenants = Tenants.from_file(args.api_key_file) if args.api_key_file else Tenants(None)
        loaded = load_model(args.model)
        engine = LLMEngine(
            loaded,
            EngineConfig(
                block_size=args.block_size,
                num_kv_blocks=args.kv_cache_blocks,
                kv_cache_bytes=args.kv_cache_bytes,
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                enable_prefix_caching=not args.no_prefix_caching,
                cache_aware_scheduling=args.cache_aware_scheduling,
                eviction_policy=args.eviction_policy,
                index=args.index,
                zero_on_evict=args.zero_on_evict,
                log_cache_keys=args.log_cache_keys,
            ),
        )
    except (ValueError, OSError) as error:  # bad model, key file, size or log path: no traceback
        print(f"prefixcache serve: {error}", file=sys.stderr)
        return 2
    name = args.served_model_name or loaded.source.name.split(".")[0]
    app = create_app(engine, tenants, name, max_pending=args.max_pending)
    print(started_banner(tenants, name, args.host, args.port), flush=True)
    print(
        f"KV pool: {engine.num_blocks} blocks of {args.block_size} tokens; prefix caching "
        f"{'off' if args.no_prefix_caching else 'on'}"
        f"{'; zero on evict' if args.zero_on_evict else ''}",
        flush=True,
    )
    if args.log_cache_keys:
        print(f"logging cache key components to {args.log_cache_keys}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0
