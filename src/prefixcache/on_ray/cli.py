"""``prefixcache ray``: deploy the engine on a Ray cluster (or a local one) behind our router.

Ray places the replicas (``--replica-cpus`` each, ``--max-replicas-per-node``), restarts
those that die and scales between ``--min-replicas`` and ``--max-replicas``. The router
listens on ``--port`` on the head node (``--routing ray``: Ray's own proxy and request
router do instead, for comparison). The tenant secret, key file and tier spec reach the
replicas through Ray, never through a command line. Ctrl-C or SIGTERM deletes the
application and stops a local Ray (exit 0); a second one skips waiting for the replicas
(exit 130); after ``STOP_SECONDS`` whatever is left is killed (exit 1).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from prefixcache.argtypes import positive_int
from prefixcache.model_names import MODEL_HELP
from prefixcache.protocol.event_flags import add_event_format_flags, event_format_args
from prefixcache.protocol.replica_flags import add_replica_flags, replica_flags, set_flags
from prefixcache.protocol.top_hint import watch_line
from prefixcache.router.cluster import EMBEDDED_REDIS, Child, free_port, redis_command, router_url
from prefixcache.shutdown import (
    CUT_SHORT,
    exit_after,
    kill_all,
    kill_descendants,
    sigterm_as_ctrl_c,
)

ROUTINGS = ("prefixcache", "ray")
READY_TIMEOUT_S = 600.0
PROXY_TIMEOUT_S = 30.0
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": a local Ray on 127.0.0.1 only
STOP_SECONDS = 60.0  # the teardown's bound (Serve gives each replica 20 s to stop)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def add_ray_parser(commands: argparse._SubParsersAction) -> None:
    """The ``ray`` subcommand and its options."""
    parser = commands.add_parser("ray", help="replicas on a Ray cluster, behind our router")
    parser.add_argument("--address", help="a running Ray cluster (default: start a local one)")
    parser.add_argument("--replicas", type=positive_int, default=2, help="(initial) replicas")
    parser.add_argument("--port", type=int, default=8000, help="the ingress's port")
    parser.add_argument("--host", default="127.0.0.1", help="the ingress's address")
    parser.add_argument("--routing", choices=ROUTINGS, default=ROUTINGS[0])
    parser.add_argument("--policy", default="cache-aware", help="the router's policy")
    parser.add_argument("--model", help=f"{MODEL_HELP}; the same on every node")
    parser.add_argument("--kv-tier", metavar="SPEC", help=f"redis://... or {EMBEDDED_REDIS}")
    parser.add_argument("--api-key-file")
    parser.add_argument("--tenant-secret-file", help="default: a new one for this run")
    add_replica_flags(parser)
    parser.add_argument("--fair-cache", action="store_true", help="tenant-fair eviction")
    parser.add_argument("--replica-cpus", type=float, default=1.0, help="Ray CPUs per replica")
    parser.add_argument("--threads", type=positive_int, help="torch threads per replica")
    parser.add_argument("--max-replicas-per-node", type=positive_int)
    parser.add_argument("--min-replicas", type=int, help="autoscaling's floor (with --max)")
    parser.add_argument("--max-replicas", type=positive_int, help="autoscale up to this many")
    parser.add_argument("--target-ongoing-requests", type=float, default=2.0)
    parser.add_argument("--upscale-delay", type=float, metavar="S", help="Ray's default: 30")
    parser.add_argument("--downscale-delay", type=float, metavar="S", help="Ray's default: 600")
    parser.add_argument(
        "--autoscale-window", type=float, metavar="S",
        help="load averaged over S seconds, pushed every S/2 (Ray's: 30, pushed every 10)",
    )  # fmt: skip
    parser.add_argument("--local-cpus", type=positive_int, help="a local cluster's CPUs")
    parser.add_argument(
        "--kv-events-token-ids", action="store_true", help="events carry token ids (opt-in)"
    )
    add_event_format_flags(parser)


def problem_with(args: argparse.Namespace) -> str | None:
    """Why these options cannot run, before anything starts."""
    if args.kv_tier and args.kv_tier.startswith("disk:"):
        return "--kv-tier disk: is one folder per process; replicas under Ray share redis://"
    if args.max_replicas is None and args.min_replicas is not None:
        return "--min-replicas needs --max-replicas (autoscaling)"
    if args.max_replicas is not None:
        low = args.min_replicas if args.min_replicas is not None else 1
        if not 1 <= low <= args.replicas <= args.max_replicas:
            return (
                "need 1 <= --min-replicas <= --replicas <= --max-replicas (no replica "
                "reports load at zero, so nothing would scale back up)"
            )
    if args.replica_cpus <= 0:
        return "--replica-cpus must be > 0"
    return None


def run_ray(args: argparse.Namespace) -> int:
    """Check, connect, deploy, wait for Ctrl-C, delete."""
    problem = problem_with(args)
    if problem is None:
        problem = _secrets_problem(args)
    if problem is not None:
        print(f"prefixcache ray: {problem}", file=sys.stderr)
        return 2
    if not args.address:
        os.environ.setdefault(LOOPBACK_ENV, "0")  # read when ray is imported
    try:
        import ray  # noqa: F401
    except ImportError:
        print(
            "prefixcache ray: Ray is not installed: pip install 'prefixcache[ray]'", file=sys.stderr
        )
        return 2
    with tempfile.TemporaryDirectory(prefix="prefixcache-ray-") as folder:
        return _deploy_and_wait(args, Path(folder))


def _secrets_problem(args: argparse.Namespace) -> str | None:
    from prefixcache.protocol.auth import Tenants
    from prefixcache.protocol.tenant_secret import load_secrets

    try:
        if args.tenant_secret_file:
            load_secrets(args.tenant_secret_file)
        if args.api_key_file:
            Tenants.from_file(args.api_key_file)
    except (ValueError, OSError) as error:
        return str(error)
    return None


def _deploy_and_wait(args: argparse.Namespace, folder: Path) -> int:
    """Deploy, serve until Ctrl-C or SIGTERM, tear down: 0 (2 if Serve refused the
    deployment), or 130 if a second signal cut the teardown short."""
    import ray
    from ray import serve

    from prefixcache.on_ray.app import build_app
    from prefixcache.on_ray.specs import APP_NAME

    redis, tier, code = *_tier(args, folder), 0
    try:
        if args.address:
            ray.init(address=args.address, log_to_driver=False)
        else:
            # "local": a Ray of our own even when another runs on this machine (Ray would
            # join that one, and refuse our num_cpus for it).
            ray.init(
                address="local",
                num_cpus=args.local_cpus,
                include_dashboard=False,
                log_to_driver=False,
            )
        sigterm_as_ctrl_c()  # Ray's own handler exits (SystemExit) from wherever it lands
        proxy = "HeadOnly" if args.routing == "ray" else "Disabled"
        serve.start(proxy_location=proxy, http_options={"host": args.host, "port": args.port})
        engine, ingress, scaling = _specs(args, folder, tier)
        print(_plan_line(args, scaling), flush=True)
        route_prefix = "/" if args.routing == "ray" else None
        serve.run(build_app(engine, ingress, scaling), name=APP_NAME, route_prefix=route_prefix)
        print(_ready_line(args), flush=True)
        if args.routing == "prefixcache":
            url, keyed = router_url(args.host, args.port), bool(args.api_key_file)
            print(f"prefixcache ray: {watch_line(url, keyed)}", flush=True)
        while True:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    except RuntimeError as error:
        print(f"prefixcache ray: {error}", file=sys.stderr, flush=True)
        code = 2
    finally:
        cut_short = _stop(args, redis)
    return CUT_SHORT if cut_short else code


class _CutShort(BaseException):
    """A second Ctrl-C or SIGTERM during the teardown (a BaseException: Ray's code catches
    Exception)."""


def _cut_short(signum: int, frame: object) -> None:
    raise _CutShort


def _stop(args: argparse.Namespace, redis: Child | None) -> bool:
    """Tear down within ``STOP_SECONDS``; a second Ctrl-C or SIGTERM meanwhile skips the
    graceful part. Whether one did."""
    previous = {sig: signal.signal(sig, _cut_short) for sig in STOP_SIGNALS}
    deadline = exit_after(STOP_SECONDS, 1, kill_descendants)
    cut = False
    try:
        _tear_down(args)
    except _CutShort:
        cut = True
        print("prefixcache ray: second signal: stopping now", flush=True)
    finally:
        for sig in STOP_SIGNALS:  # what is left to do is quick: a third signal changes nothing
            signal.signal(sig, signal.SIG_IGN)
        _release_ray()
        if redis is not None and redis.process is not None:
            kill_all([redis.process], 0.0 if cut else 5.0)
        deadline.cancel()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print("prefixcache ray: stopped", flush=True)
    return cut


def _tier(args: argparse.Namespace, folder: Path) -> tuple[Child | None, str | None]:
    """The tier spec the replicas get; an embedded redis-server started for it if asked."""
    if args.kv_tier != EMBEDDED_REDIS:
        return None, args.kv_tier
    port = free_port()
    redis = Child("redis", redis_command(port, folder))  # dies with us, even on SIGKILL
    redis.start()
    return redis, f"redis://127.0.0.1:{port}/0"


def _specs(args: argparse.Namespace, folder: Path, tier: str | None):
    """What each deployment is given (secrets as contents, read once here)."""
    from prefixcache.on_ray.app import Scaling
    from prefixcache.on_ray.specs import INGRESS, EngineSpec, IngressSpec
    from prefixcache.protocol.tenant_secret import load_or_create_secret

    secret_file = Path(args.tenant_secret_file or folder / "tenant-secret")
    load_or_create_secret(secret_file)
    secret = secret_file.read_bytes()
    keys = Path(args.api_key_file).read_bytes() if args.api_key_file else None
    threads = args.threads or max(1, int(args.replica_cpus))
    routed = args.routing == "prefixcache"
    engine = EngineSpec(
        _serve_flags(args), secret, keys, tier, threads, INGRESS if routed else None
    )
    route_flags = ["--policy", args.policy] + (["--model", args.model] if args.model else [])
    ingress = (
        IngressSpec(args.host, args.port, tuple(route_flags), secret, keys) if routed else None
    )
    delays = {
        "upscale_delay_s": args.upscale_delay,
        "downscale_delay_s": args.downscale_delay,
        "look_back_period_s": args.autoscale_window,
        # how often replicas push their load: half the window, at most Ray's default
        "metrics_interval_s": min(10.0, args.autoscale_window / 2)
        if args.autoscale_window
        else None,
    }
    scaling = Scaling(
        args.replicas, args.min_replicas, args.max_replicas, args.target_ongoing_requests,
        args.replica_cpus, args.max_replicas_per_node,
        {name: value for name, value in delays.items() if value is not None},
    )  # fmt: skip
    return engine, ingress, scaling


def _serve_flags(args: argparse.Namespace) -> tuple[str, ...]:
    flags = event_format_args(args) + replica_flags(args) + set_flags([("--model", args.model)])
    switches = {"--fair-cache": args.fair_cache, "--kv-events-token-ids": args.kv_events_token_ids}
    flags += [flag for flag, on in switches.items() if on]
    return tuple(flags)


def _plan_line(args: argparse.Namespace, scaling) -> str:
    count = (
        f"{args.replicas} replicas"
        if scaling.maximum is None
        else f"{args.replicas} replicas (autoscaling {scaling.minimum or 1}-{scaling.maximum})"
    )
    front = "our router" if args.routing == "prefixcache" else "Ray's proxy and router"
    return (
        f"prefixcache ray: deploying {count} of {scaling.cpus:g} CPU each behind {front} "
        f"on http://{args.host}:{args.port}; waiting for them to load the model..."
    )


def _ready_line(args: argparse.Namespace) -> str:
    """Once every replica is up (and, behind our router, registered)."""
    from ray import serve

    from prefixcache.on_ray.specs import APP_NAME

    if args.routing == "ray":
        _wait_for_proxy(args)
        return f"prefixcache ray: ready at {router_url(args.host, args.port)} (Ray's routing)"
    handle = serve.get_app_handle(APP_NAME)
    deadline = time.monotonic() + READY_TIMEOUT_S
    members = handle.replicas.remote().result()
    while len(members) < args.replicas and time.monotonic() < deadline:
        time.sleep(0.5)
        members = handle.replicas.remote().result()
    nodes = len({member["node"] for member in members})
    return (
        f"prefixcache ray: ready: {len(members)} replicas on {nodes} nodes at "
        f"{router_url(args.host, args.port)}"
    )


def _wait_for_proxy(args: argparse.Namespace) -> None:
    """Ray's proxy answers on the port; RuntimeError if Serve already ran without one there."""
    import httpx

    from prefixcache.protocol import loopback_http

    url = f"{router_url(args.host, args.port)}/-/healthz"
    deadline = time.monotonic() + PROXY_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            loopback_http.get(url, timeout=2.0)
            return
        except httpx.HTTPError:
            time.sleep(0.5)
    raise RuntimeError(
        f"no Ray Serve proxy answers on {args.host}:{args.port} after {PROXY_TIMEOUT_S:.0f} s: "
        "Serve was already running on this cluster with other HTTP options (they are fixed "
        "while it runs); stop its applications or use --routing prefixcache"
    )


def _tear_down(args: argparse.Namespace) -> None:
    """Delete the application (its replicas stop their servers), then disconnect."""
    import ray
    from ray import serve

    from prefixcache.on_ray.specs import APP_NAME

    if ray.is_initialized():
        serve.delete(APP_NAME)
        if not args.address or not serve.status().applications:
            serve.shutdown()  # leave a cluster as found: Serve only if it runs nothing else
        ray.shutdown()


def _release_ray() -> None:
    """What the graceful part left: the application's deletion asked for (not waited on)
    and Ray disconnected, which stops a local Ray's processes."""
    import ray
    from ray import serve

    from prefixcache.on_ray.specs import APP_NAME

    if ray.is_initialized():
        with contextlib.suppress(Exception):  # the controller may be gone already
            serve.delete(APP_NAME, _blocking=False)
        ray.shutdown()
