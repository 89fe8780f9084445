"""``prefixcache serve``: load the model, build the engine, run uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from prefixcache.argtypes import non_negative_int, positive_int, unit_share
from prefixcache.cache.common import DEFAULT_BLOCK_SIZE
from prefixcache.cache.index import DEFAULT_INDEX, INDEX_NAMES
from prefixcache.cache.policies import DEFAULT_POLICY, POLICY_NAMES
from prefixcache.cache.retention import DEFAULT_SHARE
from prefixcache.engine.config import (
    DECODE_ACTIVATIONS,
    DEFAULT_DECODE_ACTIVATIONS,
    DEFAULT_KV_CACHE_BYTES,
    DEFAULT_KV_CACHE_DTYPE,
    DEFAULT_KV_LAYOUT,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_STEP_TARGET_MS,
    KV_CACHE_DTYPES,
    KV_LAYOUTS,
)
from prefixcache.model_names import MODEL_HELP
from prefixcache.protocol.access_log import add_health_log_flag, quiet_health_checks
from prefixcache.protocol.event_flags import add_event_format_flags
from prefixcache.protocol.limit_flags import add_limit_flags, limits_from
from prefixcache.shutdown import TEARDOWN_SECONDS, hold_point

DEFAULT_SHUTDOWN_TIMEOUT = 5.0  # seconds running requests get to finish after SIGTERM

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from fastapi import FastAPI

    from prefixcache.engine.engine import LLMEngine
    from prefixcache.engine.weights import LoadedModel
    from prefixcache.protocol.auth import Tenants
    from prefixcache.protocol.tenant_secret import TenantSecrets
    from prefixcache.server.events import KVEventPublisher
    from prefixcache.server.metrics import ServerMetrics
    from prefixcache.server.trace_out import TraceWriter


def add_serve_parser(commands: argparse._SubParsersAction) -> None:
    """The ``serve`` subcommand and its options."""
    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("--model", help=MODEL_HELP)
    serve.add_argument("--served-model-name", help="name clients send (default: file name)")
    serve.add_argument(
        "--chat-template",
        metavar="FILE",
        help="Jinja chat template to use instead of the model's own (a base model has none)",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    size = serve.add_mutually_exclusive_group()
    size.add_argument(
        "--kv-cache-blocks",
        type=positive_int,
        help="KV pool size in blocks that every layer holds (a hybrid layout's pool gets the "
        "pages those take: 1 + window groups each)",
    )
    size.add_argument(
        "--kv-cache-bytes",
        type=positive_int,
        default=DEFAULT_KV_CACHE_BYTES,
        help=f"KV pool size in bytes (default {DEFAULT_KV_CACHE_BYTES / 2**30:g} GiB)",
    )
    serve.add_argument(
        "--kv-cache-dtype",
        default=DEFAULT_KV_CACHE_DTYPE,
        choices=KV_CACHE_DTYPES,
        help="what the KV pool stores K/V as: bfloat16 holds 2x the tokens of float32 in "
        "the same bytes, int8 (per-token, per-head scales) 3.8x (default %(default)s)",
    )
    serve.add_argument(
        "--kv-layout",
        default=DEFAULT_KV_LAYOUT,
        choices=KV_LAYOUTS,
        help="hybrid: a model's sliding-window layers keep only their window's K/V (Gemma 3: "
        "15 of 18 layers), full: every layer keeps every token (default %(default)s)",
    )
    serve.add_argument("--block-size", type=positive_int, default=DEFAULT_BLOCK_SIZE)
    serve.add_argument("--max-num-seqs", type=positive_int, default=DEFAULT_MAX_NUM_SEQS)
    serve.add_argument(
        "--max-num-batched-tokens", type=positive_int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS
    )
    serve.add_argument(
        "--step-target-ms",
        type=non_negative_int,
        default=int(DEFAULT_STEP_TARGET_MS),
        help="a step's time target while others wait or stream (default: "
        f"{DEFAULT_STEP_TARGET_MS:g}, measured); 0: the token budget only",
    )
    _add_limit_options(serve)
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
    serve.add_argument(
        "--fair-cache",
        action="store_true",
        help="tenant-fair eviction: a tenant over its share of the cached pool is evicted "
        'first (per tenant: "cache_share"; equal shares when none is given)',
    )
    serve.add_argument(
        "--retention-budget",
        type=unit_share,
        default=DEFAULT_SHARE,
        metavar="SHARE",
        help="share of the KV pool one tenant may retain with prompt_cache_retention "
        f'(default {DEFAULT_SHARE:g}; per tenant: "retention_budget")',
    )
    serve.add_argument(
        "--threads", type=positive_int, help="torch intra-op threads (default: torch's choice)"
    )
    serve.add_argument(
        "--dequantize",
        action="store_true",
        help="run a GGUF's Q4/Q8_0 weights dequantized to fp32 (exact, slower decode; "
        "default: torch's int4 kernel, bf16 activations at each matmul)",
    )
    serve.add_argument(
        "--decode-activations",
        default=DEFAULT_DECODE_ACTIVATIONS,
        choices=DECODE_ACTIVATIONS,
        help="what a GGUF's decode kernels multiply the weights by: int16 (each 32 activations "
        "as 15-bit codes and a scale, within 1/32,512 of their largest, for steps of one or two "
        "rows; more rows keep fp32), fp32 (exact), or int8 (codes of 8 bits, as llama.cpp "
        "does: fastest, within 1/254); default %(default)s",
    )
    serve.add_argument(
        "--weight-cache",
        metavar="DIR",
        help="folder of a GGUF's packed int4 weights, built at the first start and read at "
        "the next (default $PREFIXCACHE_CACHE_DIR or ~/.cache/prefixcache; delete to clear)",
    )
    serve.add_argument(
        "--no-weight-cache", action="store_true", help="build the packed weights at every start"
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT stop admitting (503), let running requests finish for this "
        "long, then end the rest (streams get an error event) and exit; the process exits "
        f"at most {TEARDOWN_SECONDS:g} s later whatever still runs, and at once (status "
        f"130) on a second signal (default {DEFAULT_SHUTDOWN_TIMEOUT:g})",
    )
    _add_tier_options(serve)
    _add_event_options(serve)
    _add_trace_option(serve)


def _add_limit_options(serve: argparse.ArgumentParser) -> None:
    """What one client may send or hold (every limit: README, "Limits")."""
    add_limit_flags(serve)
    serve.add_argument(
        "--metrics-port",
        type=positive_int,
        help="also serve /metrics without a key on 127.0.0.1:PORT (on the main port, "
        "/metrics needs an admin key when there is an API key file)",
    )
    add_health_log_flag(serve)


def _add_tier_options(serve: argparse.ArgumentParser) -> None:
    """The second KV tier and the tenant secret that makes its blocks shareable."""
    serve.add_argument(
        "--kv-tier",
        metavar="SPEC",
        help="second KV tier: disk:PATH, redis://HOST:PORT/DB, rediss://:PASSWORD@HOST:PORT/DB "
        "or redis+cluster://HOST:PORT; env:NAME reads it from environment variable NAME, so a "
        "password stays off the command line",
    )
    serve.add_argument(
        "--kv-tier-max-bytes", type=positive_int, help="disk tier size cap (default 4 GiB)"
    )
    serve.add_argument(
        "--kv-tier-max-wait",
        type=float,
        default=0.5,
        help="seconds a request may wait for its tier blocks, at most (default 0.5)",
    )
    serve.add_argument(
        "--tenant-secret-file",
        metavar="PATH",
        help="shared secret for tenant salts (created if missing): replicas that share it "
        "share tier blocks; with a disk tier it defaults to PATH/tenant-secret",
    )


def _add_trace_option(serve: argparse.ArgumentParser) -> None:
    """Traffic captured for the simulator."""
    serve.add_argument(
        "--trace-out",
        metavar="PATH",
        help="append one Mooncake-format line per request (block digests as ids, never "
        "tokens or text) for `prefixcache simulate`",
    )


def _add_event_options(serve: argparse.ArgumentParser) -> None:
    """KV events in vLLM's wire format, for routers."""
    serve.add_argument("--kv-events", metavar="ENDPOINT", help="ZMQ PUB, e.g. tcp://127.0.0.1:5557")
    serve.add_argument("--kv-events-replay", metavar="ENDPOINT", help="ZMQ ROUTER for replay")
    serve.add_argument(
        "--kv-events-token-ids",
        action="store_true",
        help="put token ids in BlockStored (they are the prompt: off by default)",
    )
    serve.add_argument(
        "--kv-events-allow-remote", action="store_true", help="allow a non-loopback bind"
    )
    add_event_format_flags(serve)


def run_serve(args: argparse.Namespace) -> int:
    """Build everything, say how it is set up, and serve until interrupted."""
    from prefixcache.engine.engine import EngineConfig, LLMEngine
    from prefixcache.engine.weights import load_model
    from prefixcache.protocol.auth import Tenants
    from prefixcache.server.app import create_app
    from prefixcache.tier.seal import TierKeys

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:
        args.kv_tier = resolve_tier_spec(args.kv_tier)
        secrets = tenant_secrets(args)
        current, previous = secrets or (None, None)
        tenants = (
            Tenants.from_file(args.api_key_file, current, previous)
            if args.api_key_file
            else Tenants(None, current, previous_secret=previous)
        )
        hold_point("model-load")
        loaded = load_model(args.model) if args.dequantize else serving_model(args)
        install_chat_template(loaded, args.chat_template)
        engine = LLMEngine(
            loaded,
            EngineConfig(
                block_size=args.block_size,
                num_kv_blocks=args.kv_cache_blocks,
                kv_cache_bytes=args.kv_cache_bytes,
                kv_cache_dtype=args.kv_cache_dtype,
                kv_layout=args.kv_layout,
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                step_target_ms=args.step_target_ms or None,
                enable_prefix_caching=not args.no_prefix_caching,
                cache_aware_scheduling=args.cache_aware_scheduling,
                eviction_policy=args.eviction_policy,
                index=args.index,
                quantized_weights=not args.dequantize,
                decode_activations=args.decode_activations,
                zero_on_evict=args.zero_on_evict,
                log_cache_keys=args.log_cache_keys,
                kv_tier=args.kv_tier,
                kv_tier_max_bytes=args.kv_tier_max_bytes,
                kv_tier_max_wait=args.kv_tier_max_wait,
                owner_shares=fair_shares(args, tenants),
                retention_budget=args.retention_budget,
                retention_budgets=tenants.retention_budgets(),
                tier_keys=TierKeys.ephemeral() if secrets is None else TierKeys(*secrets),
            ),
        )
        publisher = start_events(args, engine)
        trace = start_trace(args.trace_out, engine)
    except (ValueError, OSError) as error:  # bad model, key file, size or log path: no traceback
        print(f"prefixcache serve: {error}", file=sys.stderr)
        return 2
    name = args.served_model_name or loaded.source.name.split(".")[0]
    limits = limits_from(args)
    app = create_app(
        engine, tenants, name, max_pending=args.max_pending, publisher=publisher, limits=limits
    )
    try:
        return _serve_until_stopped(app, args, tenants, name)
    finally:  # however it ends (a signal during start-up too): no worker outlives the server
        app.state.server.pool.close()
        if trace is not None:
            trace.close()


def _serve_until_stopped(
    app: FastAPI, args: argparse.Namespace, tenants: Tenants, name: str
) -> int:
    """Say how the server is set up, serve until a signal; 0, or 130 if a second signal
    cut the graceful shutdown short."""
    from prefixcache.protocol.top_hint import local_url, watch_line
    from prefixcache.server.app import graceful_server, started_banner
    from prefixcache.server.prepare_pool import WARM_QUIET_SECONDS
    from prefixcache.tier import redact

    server = app.state.server  # large bodies' worker processes, once the engine is quiet
    engine = server.engine
    server.pool.warm(
        server.prepare, lambda: server.async_engine.num_pending > 0, WARM_QUIET_SECONDS
    )
    print(started_banner(tenants, name, args.host, args.port), flush=True)
    print(watch_line(local_url(args.host, args.port), not tenants.local), flush=True)
    print(
        f"KV pool: {engine.num_blocks} blocks of {args.block_size} tokens, "
        f"{engine.kv_cache_dtype} ({engine.kv_store.bytes_per_token:,} bytes a token in every "
        f"layer); {engine.layout.describe(engine.kv_store.bytes_per_page_token)}; "
        f"prefix caching {'off' if args.no_prefix_caching else 'on'}"
        f"{'; zero on evict' if args.zero_on_evict else ''}",
        flush=True,
    )
    print(describe_fair_cache(args, tenants), flush=True)
    if args.log_cache_keys:
        print(f"logging cache key components to {args.log_cache_keys}", flush=True)
    if engine.tier is not None:
        print(f"KV tier: {engine.tier.client.medium} ({redact(args.kv_tier)})", flush=True)
    if app.state.kv_events is not None:
        publisher = app.state.kv_events
        print(f"KV events: {publisher.endpoint} topic {publisher.topic}", flush=True)
    if args.metrics_port:
        try:
            serve_metrics(server.metrics, args.metrics_port)
        except OSError as error:  # the port is taken
            print(
                f"prefixcache serve: --metrics-port {args.metrics_port}: {error}", file=sys.stderr
            )
            return 2
    quiet_health_checks(args.log_health_checks)
    uvicorn_server = graceful_server(
        app, args.host, args.port, args.shutdown_timeout, hard_deadline=True
    )
    return uvicorn_server.run_until_stopped()


def install_chat_template(loaded: LoadedModel, path: str | None) -> None:
    """``--chat-template FILE`` in place of the model's own template; either one rendered
    once on a sample conversation. ValueError of one line naming the file otherwise."""
    tokenizer = loaded.tokenizer
    if path is None:
        try:
            tokenizer.check_chat_template()
        except ValueError as error:
            raise ValueError(f"{loaded.source}: {error}; pass --chat-template FILE") from None
        return
    try:
        source = Path(path).read_text("utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"--chat-template {path}: cannot read it ({error})") from None
    try:
        tokenizer.use_chat_template(source)
    except ValueError as error:
        raise ValueError(f"--chat-template {path}: {error}") from None


def serving_model(args: argparse.Namespace) -> LoadedModel:
    """The model built for int4 kernels, through the weight cache unless it is turned off."""
    from prefixcache.engine.cache_folder import default_cache_dir
    from prefixcache.engine.weight_cache import load_serving_model

    folder = None if args.no_weight_cache else Path(args.weight_cache or default_cache_dir())
    return load_serving_model(args.model, folder)


def serve_metrics(metrics: ServerMetrics, port: int) -> WSGIServer:
    """/metrics without a key, on loopback only, from a daemon thread; in the text format
    the main port serves, whatever the scraper accepts (``metrics_wsgi_app``)."""
    import threading
    from wsgiref.simple_server import make_server

    from prometheus_client.exposition import ThreadingWSGIServer

    from prefixcache.server.metrics import QuietHandler, metrics_wsgi_app

    app = metrics_wsgi_app(metrics)
    server = make_server("127.0.0.1", port, app, ThreadingWSGIServer, handler_class=QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics-port", daemon=True).start()
    print(f"metrics: http://127.0.0.1:{port}/metrics (loopback only, no key)", flush=True)
    return server


def start_trace(path: str | None, engine: LLMEngine) -> TraceWriter | None:
    """Append one Mooncake-format line per finished request to ``path``, if asked."""
    if path is None:
        return None
    from prefixcache.server.trace_out import TraceWriter

    trace = TraceWriter(path, engine.manager)
    engine.on_retired.append(trace.record)
    print(f"trace: one line per request (digests as ids, never tokens) to {path}", flush=True)
    return trace


def fair_shares(args: argparse.Namespace, tenants: Tenants) -> dict[str, float] | None:
    """``--fair-cache``: each tenant's ``cache_share`` (the rest split equally); None: off."""
    return tenants.cache_shares() if args.fair_cache else None


def describe_fair_cache(args: argparse.Namespace, tenants: Tenants) -> str:
    """One start-up line: whether eviction is tenant-fair, and with which shares."""
    shares = tenants.cache_shares()
    listed = ", ".join(f"{name} {share:g}" for name, share in shares.items())
    if not args.fair_cache:
        ignored = f" (cache_share ignored: {listed})" if shares else ""
        return f"fair cache: off, one eviction order for every tenant{ignored}"
    return f"fair cache: on; shares {listed + ', ' if listed else ''}the rest split equally"


SHARED_TIER_WITHOUT_SECRET = (
    "warning: a shared KV tier without --tenant-secret-file: tenant salts are drawn anew by "
    "each process, so this server reads no block another replica or its own last run stored "
    "(the tier stays cold after every restart); give every replica the same "
    "--tenant-secret-file (hex, mode 0600)"
)


def resolve_tier_spec(spec: str | None) -> str | None:
    """``env:NAME`` reads the tier spec from the environment (a password stays off argv)."""
    if spec is None or not spec.startswith("env:"):
        return spec
    name = spec.removeprefix("env:")
    value = os.environ.get(name)
    if not value:
        raise ValueError(f"--kv-tier {spec}: environment variable {name} is not set")
    return value


def tenant_secrets(args: argparse.Namespace) -> TenantSecrets | None:
    """The tenant secret (and a previous one, rotating): from its file, or kept beside a
    disk tier; None: per process."""
    from prefixcache.protocol.tenant_secret import load_secrets

    if args.tenant_secret_file:
        return load_secrets(args.tenant_secret_file)
    if args.kv_tier and args.kv_tier.startswith("disk:"):
        return load_secrets(Path(args.kv_tier.removeprefix("disk:")) / "tenant-secret")
    if args.kv_tier:  # a shared tier (Redis): salts that die with the process share nothing
        print(SHARED_TIER_WITHOUT_SECRET, file=sys.stderr, flush=True)
    return None


def start_events(args: argparse.Namespace, engine: LLMEngine) -> KVEventPublisher | None:
    """Publish the engine's KV events, if asked (loopback only unless allowed)."""
    if not args.kv_events:
        return None
    import zmq

    from prefixcache.server.events import KVEventPublisher, sink_for

    try:
        publisher = KVEventPublisher(
            args.kv_events,
            args.kv_events_replay,
            topic=args.kv_events_topic,
            wire_format=args.kv_events_format,
            allow_remote=args.kv_events_allow_remote,
        )
    except zmq.ZMQError as error:  # a port in use, a malformed endpoint
        raise ValueError(f"--kv-events {args.kv_events}: {error}") from None
    engine.set_event_sink(
        sink_for(publisher, include_token_ids=args.kv_events_token_ids),
        token_ids=args.kv_events_token_ids,
    )
    return publisher
