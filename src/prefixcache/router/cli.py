"""``prefixcache route``: an OpenAI-compatible front over replicas, routing on their caches."""

from __future__ import annotations

import argparse
import logging
import sys

from prefixcache.argtypes import non_negative_int, positive_int
from prefixcache.model_names import MODEL_HELP
from prefixcache.protocol.access_log import add_health_log_flag, quiet_health_checks
from prefixcache.protocol.limit_flags import add_limit_flags, limits_from
from prefixcache.router.affinity import DEFAULT_MAX_KEYS
from prefixcache.router.policy import (
    DEFAULT_BALANCE_ABS,
    DEFAULT_BALANCE_REL,
    DEFAULT_LOAD_WEIGHT,
    DEFAULT_POLICY,
    DEFAULT_PREFIX_BLOCKS,
    DEFAULT_TIER_WEIGHT,
    POLICY_NAMES,
)
from prefixcache.router.replicas import DEFAULT_HEALTH_INTERVAL_S, DEFAULT_HEALTH_TIMEOUT_S

DEFAULT_PORT = 8080
DEFAULT_SHUTDOWN_TIMEOUT = 5.0  # seconds running requests get to finish after a signal


def add_route_parser(commands: argparse._SubParsersAction) -> None:
    """The ``route`` subcommand and its options."""
    route = commands.add_parser("route", help="OpenAI-compatible router over replicas")
    route.add_argument(
        "--replica",
        action="append",
        default=[],
        metavar="URL",
        help="a replica's base URL (repeat)",
    )
    route.add_argument(
        "--replicas-file",
        metavar="PATH",
        help="a JSON replica list re-read when it changes (docs/ray.md; prefixcache ray writes it)",
    )
    route.add_argument("--host", default="127.0.0.1")
    route.add_argument("--port", type=int, default=DEFAULT_PORT)
    route.add_argument("--policy", default=DEFAULT_POLICY, choices=POLICY_NAMES)
    route.add_argument("--model", help=f"the replicas' model, for its tokenizer: {MODEL_HELP}")
    route.add_argument("--api-key-file", help="the replicas' key file: the router checks keys too")
    route.add_argument(
        "--tenant-secret-file",
        metavar="PATH",
        help="the replicas' tenant secret: without it the router cannot compute their digests",
    )
    add_limit_flags(route)
    route.add_argument(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT stop accepting, let running requests finish for this long, "
        "then cancel the rest and exit; a second signal exits at once (status 130) "
        f"(default {DEFAULT_SHUTDOWN_TIMEOUT:g})",
    )
    _add_tuning(route)


def _add_tuning(route: argparse.ArgumentParser) -> None:
    """The cache-aware score, prefix-hash and health-check knobs."""
    route.add_argument(
        "--tier-weight",
        type=float,
        default=DEFAULT_TIER_WEIGHT,
        help="a tier block's worth vs a pool block",
    )
    route.add_argument(
        "--load-weight",
        type=float,
        default=DEFAULT_LOAD_WEIGHT,
        help="blocks one queued request costs",
    )
    route.add_argument("--balance-abs-threshold", type=float, default=DEFAULT_BALANCE_ABS)
    route.add_argument("--balance-rel-threshold", type=float, default=DEFAULT_BALANCE_REL)
    route.add_argument(
        "--prefix-blocks",
        type=positive_int,
        default=DEFAULT_PREFIX_BLOCKS,
        help="blocks prefix-hash keys on",
    )
    route.add_argument(
        "--health-interval",
        type=float,
        default=DEFAULT_HEALTH_INTERVAL_S,
        help="seconds between checks",
    )
    route.add_argument("--health-timeout", type=float, default=DEFAULT_HEALTH_TIMEOUT_S)
    route.add_argument(
        "--affinity-keys", type=non_negative_int, default=DEFAULT_MAX_KEYS, metavar="N",
        help="prompt_cache_keys (per tenant) kept on their replica, least recent forgotten "
        "first; 0 turns key affinity off (default: %(default)s)",
    )  # fmt: skip
    add_health_log_flag(route)


def build_config(args: argparse.Namespace):  # -> RouterConfig (imported lazily: FastAPI, httpx)
    """Tenants, tokenizer and policy from the flags; ValueError/OSError for bad files."""
    from prefixcache.protocol.auth import Tenants
    from prefixcache.protocol.tenant_secret import load_or_create_secret
    from prefixcache.router.app import RouterConfig
    from prefixcache.router.policy import CacheAwareWeights, make_policy

    secret = load_or_create_secret(args.tenant_secret_file) if args.tenant_secret_file else None
    tenants = (
        Tenants.from_file(args.api_key_file, secret) if args.api_key_file else Tenants(None, secret)
    )
    weights = CacheAwareWeights(
        args.tier_weight, args.load_weight, args.balance_abs_threshold, args.balance_rel_threshold
    )
    if not args.replica and not args.replicas_file:
        raise ValueError("give at least one --replica URL or a --replicas-file")
    policy = make_policy(args.policy, weights, args.prefix_blocks)
    tokenizer = None
    if policy.uses_digests:
        from prefixcache.engine.model_files import load_tokenizer

        tokenizer = load_tokenizer(args.model)
    return RouterConfig(
        args.replica,
        policy,
        tenants,
        tokenizer,
        health_interval_s=args.health_interval,
        health_timeout_s=args.health_timeout,
        limits=limits_from(args),
        max_pending=args.max_pending,
        affinity_keys=args.affinity_keys,
        replicas_file=args.replicas_file,
    )


def run_route(args: argparse.Namespace) -> int:
    """Build the router, say how it is set up, and serve until interrupted."""
    from prefixcache.protocol.front import uvicorn_config
    from prefixcache.router.app import create_router_app
    from prefixcache.router.drain import DrainingServer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health check otherwise
    try:
        config = build_config(args)
    except (ValueError, OSError) as error:
        print(f"prefixcache route: {error}", file=sys.stderr)
        return 2
    print(
        f"prefixcache routing on http://{args.host}:{args.port} over "
        + (f"the replicas in {args.replicas_file}" if args.replicas_file else "")
        + (" and " if args.replicas_file and config.replicas else "")
        + (f"{len(config.replicas)} replicas" if config.replicas else "")
        + f", policy {config.policy.name}",
        flush=True,
    )
    if config.policy.uses_digests and not args.tenant_secret_file:
        print(
            "warning: no --tenant-secret-file: the replicas' salts are HMACs under their tenant "
            "secret, so no digest will match theirs and only the router's own placements count",
            flush=True,
        )
    if args.api_key_file and not config.tenants.admin_headers():
        print(
            "warning: the key file has no admin tenant: replicas' /metrics need an admin key, "
            "so the router cannot read their load and balances on its own in-flight counts",
            flush=True,
        )
    app = create_router_app(config)
    quiet_health_checks(args.log_health_checks)
    timeout = config.limits.request_read_timeout
    uvicorn_options = {"log_level": "info", "timeout_graceful_shutdown": args.shutdown_timeout}
    server_config = uvicorn_config(app, args.host, args.port, timeout, **uvicorn_options)
    uvicorn_server = DrainingServer(server_config, app.state.router.forwarder.drain)
    return uvicorn_server.run_until_stopped()
