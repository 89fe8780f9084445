"""`prefixcache cluster`: N replicas, their KV events, a router, one Ctrl-C stops them all.

Every child is a plain `prefixcache serve` or `prefixcache route` process, so the same
commands run the replicas on other machines: the router only needs their URLs (and reads
their event endpoints from `/health`). The cores are divided among the replicas; one
tenant secret is shared, so the router computes the replicas' digests and a shared tier
serves every replica. A child that dies is reported and restarted after a short backoff.
It says when the router sees the replicas join (the router answers 503 until one has).

Stopping: Ctrl-C or SIGTERM sends every child SIGTERM at once (Redis last) and kills those
still running after their own deadline; a second signal kills them at once (status 130).
Each child runs under a parent-death signal, so even a SIGKILLed cluster leaves none.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from prefixcache.model_names import MODEL_HELP
from prefixcache.protocol import loopback_http
from prefixcache.protocol.event_flags import add_event_format_flags, event_format_args
from prefixcache.protocol.replica_flags import add_replica_flags, replica_flags, set_flags
from prefixcache.protocol.tenant_secret import load_secrets
from prefixcache.protocol.top_hint import watch_line
from prefixcache.shutdown import (
    CUT_SHORT,
    TEARDOWN_SECONDS,
    StopRequest,
    kill_all,
    with_parent_death,
)

EMBEDDED_REDIS = "redis://embedded"
RESTART_BACKOFF_S = 2.0
HEALTH_POLL_TIMEOUT_S = 1.0
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
DEFAULT_SHUTDOWN_TIMEOUT = 5.0  # each child's graceful part; SIGKILL after its hard deadline


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` (loopback by default) that nobody listens on right now."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def address(host: str, port: int) -> str:
    """``host:port``, brackets around an IPv6 host."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


TIER_ENV = "PREFIXCACHE_KV_TIER"  # the replicas read their tier spec here, not from argv


@dataclass(slots=True)
class Child:
    """One supervised process: its command, the process, and how often it restarted."""

    name: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)  # added to ours: secrets stay off argv
    process: subprocess.Popen | None = None
    restarts: int = 0
    died_at: float | None = None

    def start(self) -> None:
        """Start it in a session of its own (a terminal's Ctrl-C is ours to pass on), under a
        parent-death signal (started from the main thread, it dies with this process)."""
        environment = {**os.environ, **self.env} if self.env else None
        command = with_parent_death(self.command)
        self.process = subprocess.Popen(command, env=environment, start_new_session=True)
        self.died_at = None

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (a clean shutdown), then SIGKILL after ``timeout``."""
        if self.process is not None:
            kill_all([self.process], timeout)


@dataclass(slots=True)
class ClusterPlan:
    """What to start: the replica and router commands, and an embedded Redis if asked."""

    replicas: list[Child] = field(default_factory=list)
    router: Child | None = None
    redis: Child | None = None
    urls: list[str] = field(default_factory=list)
    secret_file: str = ""  # the tenant secret every child shares


def add_cluster_parser(commands: argparse._SubParsersAction) -> None:
    """The ``cluster`` subcommand and its options."""
    cluster = commands.add_parser("cluster", help="N replicas and a cache-aware router")
    cluster.add_argument("--replicas", type=int, default=2)
    cluster.add_argument("--port", type=int, default=8000, help="the router's port")
    cluster.add_argument("--host", default="127.0.0.1")
    cluster.add_argument("--model", help=MODEL_HELP)
    cluster.add_argument(
        "--kv-tier",
        metavar="SPEC",
        help=f"a tier for every replica: {EMBEDDED_REDIS} (a local redis-server), "
        "redis://..., or disk:PATH (one folder per replica)",
    )
    cluster.add_argument("--policy", default="cache-aware")
    cluster.add_argument("--api-key-file")
    cluster.add_argument("--tenant-secret-file", help="default: a new one in a temp folder")
    add_replica_flags(cluster)
    cluster.add_argument("--threads", type=int, help="per replica (default: cores / replicas)")
    cluster.add_argument(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT,
        metavar="SECONDS",
        help="on Ctrl-C/SIGTERM each replica and the router let running requests finish for "
        f"this long (default {DEFAULT_SHUTDOWN_TIMEOUT:g}); a second signal kills them at once",
    )
    add_event_format_flags(cluster)


def plan_cluster(args: argparse.Namespace, workdir: Path) -> ClusterPlan:
    """Ports, the shared secret and every child's command line."""
    plan = ClusterPlan()
    secret = args.tenant_secret_file or str(workdir / "tenant-secret")
    tier = args.kv_tier
    if tier == EMBEDDED_REDIS:
        port = free_port()
        plan.redis = Child("redis", redis_command(port, workdir))
        tier = f"redis://127.0.0.1:{port}/0"
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.replicas)
    for index in range(args.replicas):
        port = free_port()
        plan.urls.append(f"http://127.0.0.1:{port}")
        replica_tier = f"{tier}/replica-{index}" if tier and tier.startswith("disk:") else tier
        command = _serve_command(args, port, secret, replica_tier, threads)
        env = {TIER_ENV: replica_tier} if replica_tier else {}  # a Redis password, if any
        plan.replicas.append(Child(f"replica-{index}", command, env))
    plan.router = Child("router", _route_command(args, plan.urls, secret))
    plan.secret_file = secret
    return plan


def _prefixcache() -> list[str]:
    return [sys.executable, "-m", "prefixcache.cli"]


def _serve_command(
    args: argparse.Namespace, port: int, secret: str, tier: str | None, threads: int
) -> list[str]:
    events, replay = free_port(), free_port()
    command = _prefixcache() + ["serve", "--port", str(port), "--tenant-secret-file", secret]
    command += ["--kv-events", f"tcp://127.0.0.1:{events}"]
    command += ["--kv-events-replay", f"tcp://127.0.0.1:{replay}", "--threads", str(threads)]
    command += ["--shutdown-timeout", str(_shutdown_timeout(args))]
    command += event_format_args(args) + replica_flags(args)
    return command + set_flags(
        (
            ("--model", args.model),
            ("--kv-tier", f"env:{TIER_ENV}" if tier else None),
            ("--api-key-file", args.api_key_file),
        )
    )


def _shutdown_timeout(args: argparse.Namespace) -> float:
    return getattr(args, "shutdown_timeout", DEFAULT_SHUTDOWN_TIMEOUT)


def _route_command(args: argparse.Namespace, urls: list[str], secret: str) -> list[str]:
    command = _prefixcache() + ["route", "--host", args.host, "--port", str(args.port)]
    command += ["--policy", args.policy, "--tenant-secret-file", secret]
    command += ["--shutdown-timeout", str(_shutdown_timeout(args))]
    for url in urls:
        command += ["--replica", url]
    for flag, value in (("--model", args.model), ("--api-key-file", args.api_key_file)):
        if value is not None:
            command += [flag, value]
    return command


def redis_command(port: int, workdir: Path) -> list[str]:
    """A redis-server from the project's own dependencies, on loopback, LRU when full."""
    binary = shutil.which("redis-server") or str(Path(sys.executable).parent / "redis-server")
    return [
        binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
        "no", "--dir", str(workdir), "--maxmemory", "2gb", "--maxmemory-policy", "allkeys-lru",
    ]  # fmt: skip


class Readiness:
    """Watches the router's ``/health``: says when replicas join, leave, and are all healthy."""

    def __init__(self, router_url: str, replicas: int) -> None:
        self.router_url, self.replicas = router_url, replicas
        self.healthy = 0
        self.since = time.monotonic()

    def poll(self) -> None:
        """One look at the router; a line only when the count of healthy replicas changed."""
        healthy = healthy_replicas(self.router_url)
        if healthy is None or healthy == self.healthy:
            return
        if healthy < self.healthy:
            self.since = time.monotonic()  # time the rejoin from here
        self.healthy = healthy
        seconds = time.monotonic() - self.since
        if healthy == self.replicas:
            print(
                f"prefixcache cluster: ready: {healthy}/{self.replicas} replicas healthy at "
                f"{self.router_url} after {seconds:.1f} s",
                flush=True,
            )
        else:
            print(f"prefixcache cluster: {healthy}/{self.replicas} replicas healthy", flush=True)


def healthy_replicas(router_url: str) -> int | None:
    """How many replicas the router has in its rotation; None if it does not answer yet."""
    try:
        body = loopback_http.get(f"{router_url}/health", timeout=HEALTH_POLL_TIMEOUT_S).json()
        return sum(1 for replica in body["replicas"] if replica["healthy"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


def router_url(host: str, port: int) -> str:
    """Where this machine reaches the router (loopback when it binds every address)."""
    return f"http://{address('127.0.0.1' if host in WILDCARD_HOSTS else host, port)}"


def supervise(
    plan: ClusterPlan,
    stop_after: float | None = None,
    readiness: Readiness | None = None,
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
) -> int:
    """Start every child, restart those that die, stop all on Ctrl-C or SIGTERM (or
    ``stop_after``): 0, or 130 if a second signal had them killed at once."""
    children = ([plan.redis] if plan.redis else []) + plan.replicas + [plan.router]
    # Ctrl-C even when started from a shell that ignores SIGINT in background jobs.
    stop = StopRequest()
    previous = {sig: signal.signal(sig, stop.handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for child in children:
            child.start()
        started = time.monotonic()
        while not stop.requested and (
            stop_after is None or time.monotonic() - started < stop_after
        ):
            for child in children:
                _restart_if_dead(child)
            if readiness is not None:
                readiness.poll()
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        cut_short = _stop_children(plan, shutdown_timeout + TEARDOWN_SECONDS + 1.0)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return CUT_SHORT if cut_short else 0


def _stop_children(plan: ClusterPlan, timeout: float) -> bool:
    """SIGTERM to the router and every replica at once, SIGKILL to those still running after
    ``timeout``, then the same for Redis (their tier until the end); a second signal meanwhile
    kills them at once. Whether it did."""
    signals: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _: signals.append(signum))
    servers = [c.process for c in [plan.router, *plan.replicas] if c and c.process]
    kill_all(servers, timeout, hurry=lambda: bool(signals))
    if plan.redis is not None and plan.redis.process is not None:
        kill_all([plan.redis.process], 5.0, hurry=lambda: bool(signals))
    return bool(signals)


def _restart_if_dead(child: Child) -> None:
    """Report a child that exited; restart it once its backoff is over."""
    if child.process is None or child.process.poll() is None:
        return
    now = time.monotonic()
    if child.died_at is None:
        child.died_at = now
        code = child.process.returncode
        print(f"prefixcache cluster: {child.name} exited with {code}; restarting", flush=True)
    elif now - child.died_at >= RESTART_BACKOFF_S:
        child.restarts += 1
        child.start()


def run_cluster(args: argparse.Namespace) -> int:
    """Plan, print where everything is, supervise until interrupted."""
    if args.replicas < 1:
        print("prefixcache cluster: --replicas must be >= 1", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="prefixcache-cluster-") as folder:
        plan = plan_cluster(args, Path(folder))
        try:  # once here, not in every child: a refused file would restart them forever
            load_secrets(plan.secret_file)
        except ValueError as error:
            print(f"prefixcache cluster: {error}", file=sys.stderr)
            return 2
        print(
            f"prefixcache cluster: router on http://{args.host}:{args.port} "
            f"({args.policy}) over {len(plan.urls)} replicas: {', '.join(plan.urls)}"
            + ("; embedded Redis for the KV tier" if plan.redis else ""),
            flush=True,
        )
        url, keyed = router_url(args.host, args.port), bool(args.api_key_file)
        print(f"prefixcache cluster: {watch_line(url, keyed)}", flush=True)
        print(
            f"prefixcache cluster: waiting for {len(plan.urls)} replicas to load the model "
            "(the router answers 503 until one is ready)...",
            flush=True,
        )
        readiness = Readiness(router_url(args.host, args.port), len(plan.urls))
        return supervise(plan, readiness=readiness, shutdown_timeout=args.shutdown_timeout)
