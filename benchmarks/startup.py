"""Seconds from process start to `/health` ok for `prefixcache serve` (issue 27).

Starts `make serve`'s command line (the default model, `--kv-tier disk:` in a temporary
folder) on a free loopback port, polls `/health` until it answers ok, and stops the server.
Cold: an empty weight cache folder (`PREFIXCACHE_CACHE_DIR`); warm: the same folder again,
as every later `make serve`, replica or restart finds it. N runs each, median; the load
average is printed beside, since the machine may be shared.

`--phases` instead times, in this process, each phase of `serve`'s start-up: imports, the
model (through the weight cache in `PREFIXCACHE_CACHE_DIR`, or `--no-cache`), the engine
(KV pool), the app. Run it twice on one folder for the warm case.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from servers import free_port, interrupt

TIMEOUT = 180.0  # seconds before a start counts as failed


def healthy(port: int) -> bool:
    """Whether `/health` answers 200 now."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as reply:
            return reply.status == 200
    except OSError:
        return False


def time_to_healthy(cache_dir: Path, extra: list[str]) -> float:
    """Start one server with `cache_dir` as its weight cache; seconds until `/health` is ok."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tier:
        command = [sys.executable, "-m", "prefixcache.cli", "serve", "--host", "127.0.0.1"]
        command += ["--port", str(port), "--kv-tier", f"disk:{tier}", *extra]
        env = {**os.environ, "PREFIXCACHE_CACHE_DIR": str(cache_dir)}
        start = time.perf_counter()
        server = subprocess.Popen(
            command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            while not healthy(port):
                if server.poll() is not None or time.perf_counter() - start > TIMEOUT:
                    raise RuntimeError(f"server exited or timed out (rc {server.returncode})")
                time.sleep(0.02)
            return time.perf_counter() - start
        finally:
            interrupt(server)


def load() -> str:
    """The 1-minute load average, for beside each number."""
    return f"{os.getloadavg()[0]:.2f}"


def phases(use_cache: bool) -> None:
    """Seconds per start-up phase, in this process (what `run_serve` does, without HTTP)."""
    mark = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        print(f"{name:<34} {now - mark:6.2f}s", flush=True)
        mark = now

    import torch  # noqa: F401

    lap("import torch")
    from prefixcache.engine.cache_folder import default_cache_dir
    from prefixcache.engine.engine import EngineConfig, LLMEngine
    from prefixcache.engine.weight_cache import EVENTS, load_serving_model

    lap("import engine")
    from prefixcache.protocol.auth import Tenants
    from prefixcache.server.app import create_app

    lap("import server (fastapi, prometheus, zmq)")
    loaded = load_serving_model(None, default_cache_dir() if use_cache else None)
    lap(f"model ({dict(EVENTS)})")
    engine = LLMEngine(loaded, EngineConfig())
    lap("engine (2 GiB KV pool)")
    create_app(engine, Tenants(None), "smollm2")
    lap("app")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=3, help="runs of each case (default 3)")
    parser.add_argument("--phases", action="store_true", help="time each phase in-process")
    parser.add_argument("--no-cache", action="store_true", help="with --phases: no weight cache")
    parser.add_argument("extra", nargs="*", help="more `serve` options (after --)")
    args = parser.parse_args()
    if args.phases:
        print(f"load {load()}")
        return phases(not args.no_cache)
    cold, warm = [], []
    for _ in range(args.n):
        with tempfile.TemporaryDirectory() as cache:
            cold.append(time_to_healthy(Path(cache), args.extra))
            print(f"cold {cold[-1]:.2f}s (load {load()})", flush=True)
            warm.append(time_to_healthy(Path(cache), args.extra))
            print(f"warm {warm[-1]:.2f}s (load {load()})", flush=True)
    cold_s, warm_s = statistics.median(cold), statistics.median(warm)
    print(f"median of {args.n}: cold {cold_s:.2f}s, warm {warm_s:.2f}s")


if __name__ == "__main__":
    main()
