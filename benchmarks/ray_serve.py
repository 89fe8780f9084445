"""Ray Serve benchmark: `prefixcache ray` vs `prefixcache cluster`, and our routing vs Ray's.

Three deployments of two replicas (one core each) on the default model, each fresh, each
given the cluster benchmark's shared-document workload (4 documents of about 500 tokens x 8
questions, interleaved, 16 requests in flight, 8 tokens out, streamed) three times, with
new documents each round; the median round counts (this machine is noisy):

- `prefixcache cluster --replicas 2`: child processes and our router (the reference);
- `prefixcache ray --replicas 2`: the same servers and router, placed by Ray Serve;
- `prefixcache ray --replicas 2 --routing ray`: Ray's proxy and its default request
  router (power of two choices on queue length) in front of the same servers.

Ray's overhead is the ratio of the first two throughputs (goal >= 0.9); the cache-aware
gain is that of the second over the third (goal >= 1.5). Ratios come from this one run.

    .venv/bin/python benchmarks/ray_serve.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from cluster import documents, run_workload, workload
from servers import free_port, interrupt

READY = ("prefixcache cluster: ready", "prefixcache ray: ready")
SETTLE_S = 2.0  # the router's first health checks and event subscriptions


def launch(command: list[str], log: Path) -> subprocess.Popen:
    """The command, its output copied to ``log``; returns once it says it is ready."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ready = threading.Event()

    def copy() -> None:
        with open(log, "w") as out:
            for line in process.stdout:
                out.write(line)
                if line.startswith(READY):
                    ready.set()

    threading.Thread(target=copy, daemon=True).start()
    deadline = time.monotonic() + 600
    while not ready.wait(0.5):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"{' '.join(command[3:5])} did not start: see {log}")
    time.sleep(SETTLE_S)
    return process


def measure(name: str, flags: list[str], rounds: list, folder: Path) -> dict:
    """One fresh deployment, each round's workload (new documents each round): the median
    round's result, and every round's total."""
    port = free_port()
    command = [sys.executable, "-m", "prefixcache.cli", *flags, "--port", str(port)]
    started = time.perf_counter()
    process = launch(command, folder / f"{name.replace(' ', '-')}.log")
    ready_s = time.perf_counter() - started
    try:
        url = f"http://127.0.0.1:{port}"
        results = [asyncio.run(run_workload(url, round_, 16)) for round_ in rounds]
    finally:
        interrupt(process, 120)
    median = sorted(results, key=lambda r: r["total"])[len(results) // 2]
    return {**median, "ready_s": ready_s, "totals": [r["total"] for r in results]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 documents x 4 questions, once")
    parser.add_argument("--rounds", type=int, default=3, help="workloads per deployment")
    args = parser.parse_args()
    docs, questions, count = (2, 4, 1) if args.quick else (4, 8, args.rounds)
    rounds = [workload(documents(docs, 420, seed=7 + n), questions) for n in range(count)]
    print(
        f"ray benchmark: {len(rounds[0])} requests ({docs} documents x {questions} "
        f"questions, interleaved), 16 at a time, 8 tokens out, 2 replicas of 1 core; "
        f"{count} rounds per deployment, new documents each, the median shown; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    local = ["--local-cpus", "2", "--replica-cpus", "1"]
    systems = {
        "prefixcache cluster": ["cluster", "--replicas", "2"],
        "prefixcache ray": ["ray", "--replicas", "2", *local],
        "ray, Ray's routing": ["ray", "--replicas", "2", "--routing", "ray", *local],
    }
    rows = {}
    with tempfile.TemporaryDirectory(prefix="ray-bench-") as folder:
        for name, flags in systems.items():
            rows[name] = row = measure(name, flags, rounds, Path(folder))
            totals = " ".join(f"{total:.2f}" for total in row["totals"])
            print(
                f"  {name:>20}  total {row['total']:6.2f}s ({totals})  TTFT p50 "
                f"{row['p50']:6.3f}s p95 {row['p95']:6.3f}s  hit {100 * row['hit']:5.1f}%  "
                f"replicas used {len(row['replicas'])}  ready after {row['ready_s']:5.1f}s",
                flush=True,
            )
    cluster, ours, rays = (rows[name]["total"] for name in systems)
    print(f"  ray / cluster throughput: {cluster / ours:.2f}x (goal >= 0.9)")
    print(f"  our routing / Ray's routing throughput: {rays / ours:.2f}x (goal >= 1.5)")
    print(f"  load average at the end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
