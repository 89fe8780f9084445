"""Does a hostile body slow anyone else down? /health latency and a stream's token gaps.

A real `prefixcache serve` (default model) in a child process. First idle: a streaming
request's inter-token gaps and /health latency alone. Then loaded: the same while one
client keeps sending 4 MiB bodies and another 100k-character single-word prompts. Prints
/health p50/p99, the stream's gap p50/p99, and the loaded/idle ratio of the gap p99
(issue 10's goal: /health p99 <= 50 ms, gap p99 grown by <= 20%).

    .venv/bin/python benchmarks/hardening.py [--tokens 150]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from servers import free_port, wait_healthy

MODEL = "SmolLM2-135M-Instruct"
BIG_BODY = json.dumps({"model": MODEL, "prompt": "word " * 838_000}).encode()  # 4.19 MB
ONE_WORD = json.dumps({"model": MODEL, "prompt": "a" * 100_000, "max_tokens": 1}).encode()


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98] if len(values) > 1 else values[0]


async def stream_gaps(http: httpx.AsyncClient, tokens: int) -> list[float]:
    """Seconds between consecutive streamed tokens of one long completion."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    stamps = []
    async with http.stream("POST", "/v1/completions", json=body) as reply:
        async for line in reply.aiter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
    return [b - a for a, b in itertools.pairwise(stamps)]


async def health_latencies(http: httpx.AsyncClient, stop: asyncio.Event) -> list[float]:
    latencies = []
    while not stop.is_set():
        started = time.perf_counter()
        (await http.get("/health")).raise_for_status()
        latencies.append(time.perf_counter() - started)
        await asyncio.sleep(0.01)
    return latencies


async def attacker(url: str, body: bytes, stop: asyncio.Event) -> list[int]:
    """Send ``body`` again and again until ``stop``; the statuses it got."""
    statuses = []
    headers = {"content-type": "application/json"}
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        while not stop.is_set():
            statuses.append((await http.post("/v1/completions", content=body, headers=headers))
                            .status_code)  # fmt: skip
    return statuses


async def measure(url: str, tokens: int, loaded: bool) -> dict:
    stop = asyncio.Event()
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        bodies = (BIG_BODY, ONE_WORD) if loaded else ()
        attackers = [asyncio.create_task(attacker(url, body, stop)) for body in bodies]
        health = asyncio.create_task(health_latencies(http, stop))
        gaps = await stream_gaps(http, tokens)
        stop.set()
        statuses = [s for task in attackers for s in await task]
        return {"gaps": gaps, "health": await health, "attacks": statuses}


def start_server(port: int, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "prefixcache.cli", "serve", "--port", str(port),
               "--served-model-name", MODEL, "--kv-cache-blocks", "2048"]  # fmt: skip
    return subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)


def report(name: str, result: dict) -> None:
    gaps, health = result["gaps"], result["health"]
    print(
        f"{name}: /health p50 {statistics.median(health) * 1000:.1f} ms p99 "
        f"{p99(health) * 1000:.1f} ms ({len(health)} probes); token gap p50 "
        f"{statistics.median(gaps) * 1000:.1f} ms p99 {p99(gaps) * 1000:.1f} ms; "
        f"attacks answered {sorted(set(result['attacks']))} x{len(result['attacks'])}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=150, help="tokens in the timed stream")
    args = parser.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as folder:
        server = start_server(port, Path(folder) / "server.log")
        try:
            wait_healthy(url)
            asyncio.run(measure(url, 20, loaded=False))  # warm-up
            idle = asyncio.run(measure(url, args.tokens, loaded=False))
            loaded = asyncio.run(measure(url, args.tokens, loaded=True))
        finally:
            server.terminate()
            server.wait(timeout=30)
    report("idle  ", idle)
    report("loaded", loaded)
    ratio = p99(loaded["gaps"]) / p99(idle["gaps"])
    print(f"token gap p99 loaded / idle: {ratio:.2f} (goal <= 1.20); "
          f"/health p99 loaded {p99(loaded['health']) * 1000:.1f} ms (goal <= 50)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
