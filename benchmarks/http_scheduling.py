"""No one waits behind another's prefill, over HTTP (issue 36): `prefixcache serve` with its
default flags (its default step target), the same with `--step-target-ms 0` (steps sized in
tokens alone: what it did before), and llama-server on the same GGUF.

On each fresh server, a 540-token document is cached first, then:
  - alone: 8 agents (the document and a new question each, 8 tokens out) one at a time,
    TTFT; one 128-token stream, its gaps between tokens; one 2,000-token prompt nobody sent
    before, 8 tokens out, its total time;
  - beside a flood: two clients send unique ~1,500-token prompts back to back (8 tokens
    out) while the same 8 agents ask one at a time and a 128-token stream runs: agents'
    TTFT p50 and p95, the stream's gap p99, and the flood's prompt tokens per second;
  - behind eight: 8 cached agents at once, then the 2,000-token prompt 50 ms later: its
    total time against its time alone.
Goals (issue 36): agents' TTFT p50 <= 1.5x and p95 <= 2x of alone beside the flood; the
stream's gap p99 <= 10x of idle; the flood's throughput >= 85% of `--step-target-ms 0`'s;
the 2,000-token request behind eight within 1.2x of alone. One run; the CPU line first.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from engine import document_prompts, text
from llama_server import ensure_built
from peers import Peer, Server, complete, cpu_line, llama_server, our_server
from prefixcache.engine.config import DEFAULT_STEP_TARGET_MS

AGENTS = 8
STREAM_TOKENS = 128
FLOOD_CLIENTS = 2
FLOOD_TOKENS = 1500
FLOOD_SECONDS = 40.0  # the flood's least duration
LONG_TOKENS = 2000


def stream_gaps(
    client: httpx.Client, server: Server, prompt: list[int], tokens: int
) -> list[float]:
    """Seconds between consecutive tokens of one greedy stream."""
    body = {"model": server.model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "min_tokens": tokens}  # fmt: skip
    times = []
    with client.stream("POST", f"{server.url}/v1/completions", json=body,
                       headers={"Connection": "close"}) as reply:  # fmt: skip
        for line in reply.iter_lines():
            data = line.startswith("data: ") and line != "data: [DONE]"
            if data and json.loads(line[6:]).get("choices"):
                times.append(time.perf_counter())
    return [b - a for a, b in itertools.pairwise(times)]


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


class Flood:
    """Clients sending unique long prompts back to back until stopped."""

    def __init__(self, client: httpx.Client, server: Server, prompts: list[list[int]]) -> None:
        self.client, self.server, self.prompts = client, server, prompts
        self.stop = threading.Event()
        self.tokens, self.lock = 0, threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(FLOOD_CLIENTS)]

    def _run(self, number: int) -> None:
        for prompt in self.prompts[number::FLOOD_CLIENTS]:
            if self.stop.is_set():
                return
            complete(self.client, self.server, prompt, 8)
            with self.lock:
                self.tokens += len(prompt)

    def __enter__(self) -> Flood:
        self.began = time.perf_counter()
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join()
        self.seconds = time.perf_counter() - self.began


def agents(
    client: httpx.Client, server: Server, prompts: list[list[int]], pause: float
) -> list[float]:
    ttfts = []
    for prompt in prompts:
        ttfts.append(complete(client, server, prompt, 8)["ttft"])
        time.sleep(pause)
    return ttfts


def measure(peer: Peer, workload: dict) -> dict:
    limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
    with Server(peer) as server, httpx.Client(timeout=600, limits=limits) as client:
        complete(client, server, workload["warm"], 2)
        complete(client, server, workload["documents"][0], 2)  # the document is cached
        asks = workload["documents"][1 : 1 + AGENTS]
        alone = {
            "ttft": agents(client, server, asks, 0.0),
            "gaps": stream_gaps(client, server, workload["stream"], STREAM_TOKENS),
            "long": complete(client, server, workload["long"][0], 8)["total"],
        }
        with Flood(client, server, workload["flood"]) as flood:
            time.sleep(3.0)  # the flood is under way
            with ThreadPoolExecutor(1) as pool:
                gaps = pool.submit(stream_gaps, client, server, workload["stream2"], STREAM_TOKENS)
                ttft = agents(client, server, asks, 0.5)
                gaps = gaps.result()
            # long enough that whole 1,500-token prompts make a steady throughput
            time.sleep(max(0.0, FLOOD_SECONDS - (time.perf_counter() - flood.began)))
        crowded = {"ttft": ttft, "gaps": gaps, "flood": flood.tokens / flood.seconds}
        with ThreadPoolExecutor(AGENTS + 1) as pool:
            ahead = [pool.submit(complete, client, server, p, 8) for p in asks]
            time.sleep(0.05)
            behind = complete(client, server, workload["long"][1], 8)["total"]
            [f.result() for f in ahead]
        return {"alone": alone, "flood": crowded, "behind": behind}


def report(name: str, r: dict) -> list[str]:
    alone, flood = r["alone"], r["flood"]
    p50 = statistics.median(flood["ttft"]) / statistics.median(alone["ttft"])
    p95 = percentile(flood["ttft"], 0.95) / percentile(alone["ttft"], 0.95)
    gap = percentile(flood["gaps"], 0.99) / percentile(alone["gaps"], 0.99)
    lines = [
        f"{name}:",
        f"  agents TTFT alone p50 {statistics.median(alone['ttft']) * 1e3:.0f} ms, "
        f"p95 {percentile(alone['ttft'], 0.95) * 1e3:.0f} ms; beside the flood p50 "
        f"{statistics.median(flood['ttft']) * 1e3:.0f} ms ({p50:.2f}x, goal <= 1.5x), p95 "
        f"{percentile(flood['ttft'], 0.95) * 1e3:.0f} ms ({p95:.2f}x, goal <= 2x)",
        f"  stream gap p99 idle {percentile(alone['gaps'], 0.99) * 1e3:.0f} ms, beside the "
        f"flood {percentile(flood['gaps'], 0.99) * 1e3:.0f} ms ({gap:.2f}x, goal <= 10x)",
        f"  flood prompt throughput {flood['flood']:.0f} tok/s",
        f"  {LONG_TOKENS}-token request alone {r['alone']['long']:.2f} s, behind {AGENTS} cached "
        f"{r['behind']:.2f} s ({r['behind'] / r['alone']['long']:.2f}x, goal <= 1.2x)",
    ]
    return lines


def workload(tokenizer) -> dict:
    rng = random.Random(36)
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []

    def unique(n: int) -> list[int]:
        return (bos + tokenizer.encode(text(rng, n)))[:n]

    return {
        "warm": bos + tokenizer.encode("Warm up."),
        "documents": document_prompts(tokenizer),
        "stream": bos + tokenizer.encode("Once upon a time, in a small village,"),
        "stream2": bos + tokenizer.encode("Write a short story about a robot who"),
        "long": [unique(LONG_TOKENS), unique(LONG_TOKENS)],
        "flood": [unique(FLOOD_TOKENS) for _ in range(80)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="name or GGUF (default: the default model)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--no-peer", action="store_true", help="skip llama-server")
    parser.add_argument(
        "--targets", default="", help="more step targets to try, in ms (e.g. 100,500)"
    )
    args = parser.parse_args()
    from prefixcache.engine.model_files import load_tokenizer, model_source

    model = model_source(args.model)
    work = workload(load_tokenizer(model))
    print("issue 36 over HTTP: agents, a stream and a long prompt beside a flood")
    print(cpu_line())
    print(f"{model.name}, {args.threads} threads, one run")
    servers = {
        f"prefixcache (default, {DEFAULT_STEP_TARGET_MS:g} ms)": our_server(model, args.threads),
        "prefixcache --step-target-ms 0": our_server(
            model, args.threads, extra=("--step-target-ms", "0")
        ),
    }
    for target in filter(None, args.targets.split(",")):
        flags = ("--step-target-ms", target)
        servers[f"prefixcache --step-target-ms {target}"] = our_server(
            model, args.threads, extra=flags
        )
    if not args.no_peer:
        servers["llama-server"] = llama_server(ensure_built(), model, args.threads)
    results = {}
    for name, start in servers.items():
        results[name] = measure(Peer(start), work)
        print("\n".join(report(name, results[name])), flush=True)
    ours, today = list(results.values())[:2]
    for name, result in results.items():
        if name.startswith("prefixcache") and result is not today:
            flood = result["flood"]["flood"] / today["flood"]["flood"]
            print(f"flood throughput, {name} vs --step-target-ms 0: {flood:.2f}x (goal >= 0.85)")
    if "llama-server" in results:
        peer = results["llama-server"]
        ratio = statistics.median(peer["flood"]["ttft"]) / statistics.median(ours["flood"]["ttft"])
        print(f"agents' TTFT p50 beside the flood, llama-server / ours: {ratio:.2f}x")


if __name__ == "__main__":
    main()
