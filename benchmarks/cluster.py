"""Cluster benchmark: two replicas on the default model behind the router, per policy.

Workload: 4 documents of about 500 tokens x 8 questions each, interleaved, 16 requests in
flight, 8 tokens out, greedy, streamed (TTFT is the first content chunk). Every policy
gets fresh replicas (one core each) and a fresh router, so no cache carries over; the
reference is one replica with both cores and the whole pool. Then the simulator: the
Mooncake trace at 4 replicas. Ratios are measured in this one run.

    .venv/bin/python benchmarks/cluster.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from servers import free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "data/mooncake_synthetic_trace.jsonl"
WORD_LIST = (
    "harbor ferry river signal timetable platform ticket carriage station morning evening "
    "weather bridge tunnel market museum garden library window engine driver passenger "
    "luggage coffee journey north south east west delay express local quiet crowded"
)
WORDS = WORD_LIST.split(" ")
MODEL = "SmolLM2-135M-Instruct"


def documents(count: int, words: int, seed: int = 7) -> list[str]:
    """Deterministic documents of varied English words (about 1.2 tokens a word)."""
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "." for _ in range(count)
    ]


def workload(docs: list[str], questions: int) -> list[list[dict]]:
    """Interleaved: question q of every document before question q + 1 of any."""
    return [
        [
            {"role": "system", "content": f"Answer from this document only.\n{doc}"},
            {
                "role": "user",
                "content": f"Question {q}: what does the document say about item {q}?",
            },
        ]
        for q in range(questions)
        for doc in docs
    ]


def start(command: list[str], log: Path) -> subprocess.Popen:
    handle = open(log, "w")  # noqa: SIM115 -- the child owns it until it exits
    return subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT)


def serve_command(port: int, threads: int, secret: Path, blocks: int) -> list[str]:
    events, replay = free_port(), free_port()
    return [
        sys.executable, "-m", "prefixcache.cli", "serve", "--port", str(port),
        "--threads", str(threads), "--tenant-secret-file", str(secret),
        "--kv-cache-blocks", str(blocks),
        "--kv-events", f"tcp://127.0.0.1:{events}", "--kv-events-replay", f"tcp://127.0.0.1:{replay}",
    ]  # fmt: skip


async def one_request(client: httpx.AsyncClient, url: str, messages: list[dict]) -> dict:
    body = {
        "model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
    }  # fmt: skip
    started = time.perf_counter()
    ttft, usage, replica = None, None, None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        replica = response.headers.get("x-prefixcache-replica")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if (
                ttft is None
                and chunk.get("choices")
                and chunk["choices"][0]["delta"].get("content")
            ):
                ttft = time.perf_counter() - started
    return {"ttft": ttft or time.perf_counter() - started, "usage": usage, "replica": replica}


async def run_workload(url: str, conversations: list[list[dict]], concurrency: int) -> dict:
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:

        async def bounded(messages: list[dict]) -> dict:
            async with limit:
                return await one_request(client, url, messages)

        started = time.perf_counter()
        results = await asyncio.gather(*(bounded(m) for m in conversations))
        total = time.perf_counter() - started
    prompt = sum(r["usage"]["prompt_tokens"] for r in results)
    cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in results)
    ttfts = sorted(r["ttft"] for r in results)
    return {
        "total": total,
        "p50": statistics.median(ttfts),
        "p95": ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))],
        "hit": cached / prompt,
        "replicas": sorted({r["replica"] for r in results if r["replica"]}),
    }


def measure(policy: str | None, conversations, concurrency: int, blocks: int) -> dict:
    """Fresh replicas (two of one core, or one of two) and a router; one workload."""
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        secret = work / "secret"
        count, threads = (1, 2) if policy is None else (2, 1)
        ports = [free_port() for _ in range(count)]
        procs = [
            start(serve_command(p, threads, secret, blocks * (2 // count)), work / f"r{p}.log")
            for p in ports
        ]
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        try:
            for url in urls:
                wait_healthy(url)
            target = urls[0]
            if policy is not None:
                port = free_port()
                route = [sys.executable, "-m", "prefixcache.cli", "route", "--port", str(port)]
                route += ["--policy", policy, "--tenant-secret-file", str(secret)]
                for url in urls:
                    route += ["--replica", url]
                procs.append(start(route, work / "router.log"))
                target = f"http://127.0.0.1:{port}"
                wait_healthy(target)
                time.sleep(2)  # the router's first health checks and event subscriptions
            return asyncio.run(run_workload(target, conversations, concurrency))
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()


def simulate(replicas: int, capacity: int) -> list[str]:
    from prefixcache.sim.cluster import simulate_cluster
    from prefixcache.sim.cluster_report import cluster_table
    from prefixcache.sim.traces import load_trace

    trace = load_trace(TRACE)
    policies = ["cache-aware", "round-robin", "prefix-hash", "least-loaded"]
    return cluster_table([simulate_cluster(trace, replicas, capacity, p) for p in policies])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 documents x 4 questions")
    parser.add_argument("--blocks", type=int, default=1200, help="KV blocks per replica")
    args = parser.parse_args()
    docs, questions = (2, 4) if args.quick else (4, 8)
    conversations = workload(documents(docs, 420), questions)
    load = os.getloadavg()[0]
    print(
        f"cluster benchmark: {len(conversations)} requests ({docs} documents x {questions} "
        f"questions, interleaved), 16 at a time, 8 tokens out; load average {load:.2f}"
    )
    rows = {}
    for policy in ["cache-aware", "round-robin", "prefix-hash", "least-loaded", None]:
        name = policy or "one replica, 2 cores, whole pool"
        rows[name] = result = measure(policy, conversations, 16, args.blocks)
        print(
            f"  {name:>34}  total {result['total']:7.2f}s  TTFT p50 {result['p50']:6.3f}s "
            f"p95 {result['p95']:6.3f}s  hit {100 * result['hit']:5.1f}%  "
            f"replicas used {len(result['replicas'])}",
            flush=True,
        )
    aware, robin = rows["cache-aware"], rows["round-robin"]
    single = rows["one replica, 2 cores, whole pool"]
    print(
        "  cache-aware / round-robin throughput: "
        f"{robin['total'] / aware['total']:.2f}x (goal >= 1.5x)"
    )
    print(
        f"  cache-aware hit rate / one replica's: {aware['hit'] / single['hit']:.3f} (goal >= 0.95)"
    )
    print("simulator, Mooncake trace, 4 replicas x 5000 blocks:")
    for line in simulate(4, 5000):
        print("  " + line)
    print(f"  load average at the end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
