"""One stream, and a shared document, against llama.cpp's own server, over HTTP (issues 27, 34).

For each model (`--model`, repeatable; by default SmolLM2-135M Q4_1 and Gemma 3 270M Q4_K_M),
each case starts a fresh server and talks to it as a client would, over loopback HTTP, with
the same GGUF, the same threads, greedy decoding,
and the same token ids as prompts (`/v1/completions` takes a list of ids), EOS ignored
(`ignore_eos`, or `min_tokens` = `max_tokens` where that is what a server knows):
  - start-up: process start to `/health` ok;
  - decode: one stream of 128 tokens, tokens/s after the first (median of 3);
  - short-prompt TTFT: 6 different prompts of ~10 tokens, one at a time, median;
  - prefill: one 2,000-token prompt seen by nobody before, prompt tokens / TTFT;
  - a 540-token document followed by 16 different questions, 8 tokens out:
    one at a time (total, and TTFT p50 of the 15 requests whose document is cached:
    llama-server reuses the longest prefix of its slot's previous prompt) and 16 at once;
  - ours, 16 at once with prefix caching off, for what the cache buys.
Ours runs three times: as `make serve` runs it (int16 activations in steps of one or two
rows), with `--decode-activations fp32` (exact), and with `--decode-activations int8`
(activations rounded to int8 per 32 in the decode kernels, as llama.cpp's CPU kernels do).
The peers: `llama-server` built from llama.cpp's source (benchmarks/llama_server.py; `-np 16`
slots of 2,304 tokens each, `-c 36864`, so the 2,000-token prompt fits one; at its defaults,
weight repacking on) and, where `make bench-peers` built `.venv-peers`, llama-cpp-python's
server (which takes text prompts only: it gets the ids decoded, and tokenizes them itself).
Ratios > 1: we are faster. One run: the machine is shared, so compare the ratios, not the
seconds. The CPU's model and vector flags are printed first: a goal must hold on every CPU.
`--isa avx2` runs both sides on an AVX2 machine's instructions on a bigger CPU: llama-server
built for AVX2 (`llama_server.py`), our kernels compiled for x86-64-v3 and torch's kernels,
MKL's and oneDNN's capped at AVX2 (`ISA_ENVIRONMENTS`); the cores stay this CPU's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

import tokenize_peers
from llama_server import ensure_built
from servers import free_port, interrupt

ROOT = Path(__file__).resolve().parent.parent
PEER_PYTHON = ROOT / ".venv-peers" / "bin" / "python"
DECODE_PROMPTS = (
    "Once upon a time, in a small village,",
    "Write a short story about a robot who",
    "The history of the printing press begins",
)
SHORT_PROMPTS = (  # each seen once per server: nothing cached
    "The capital of France is",
    "The three primary colours are",
    "def add(a, b):",
    "Water boils at a temperature of",
    "The quick brown fox jumps over",
    "My favourite season of the year is",
)
DECODE_TOKENS = 128
PREFILL_TOKENS = 2000
MODELS = ("smollm2", "gemma3-270m")
ISA_ENVIRONMENTS = {  # what each side's server process runs with, by `--isa`
    "native": {},
    "avx2": {
        "PREFIXCACHE_KERNEL_MARCH": "x86-64-v3",  # our kernels (kernels/__init__.py)
        "ATEN_CPU_CAPABILITY": "avx2",  # torch's own vectorized kernels
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",  # torch's sgemm
        "ONEDNN_MAX_CPU_ISA": "AVX2",
    },
}
Starter = Callable[[int], subprocess.Popen]


@dataclass(frozen=True)
class Prompts:
    """Token ids of every prompt the cases send."""

    warm_up: list[int]  # shares no prefix with the others
    decode: list[list[int]]
    short: list[list[int]]
    documents: list[list[int]]
    long: list[int]  # PREFILL_TOKENS, shared with no other prompt


@dataclass(frozen=True)
class Peer:
    """A server to measure: how to start one on a port, and what answers once it is up."""

    start: Starter
    health: str = "/health"
    # llama-cpp-python's server takes prompts as text only: it gets the ids decoded
    detokenize: Callable[[list[int]], str] | None = None


# Every server's disk tier lives under one folder, removed when the benchmark exits (a
# folder per server left behind filled /tmp: ~170 MB a server, 11 GB over a few runs).
_TIERS = tempfile.TemporaryDirectory(prefix="peers-tiers-")


def our_server(
    model: Path,
    threads: int,
    caching: bool = True,
    extra: tuple[str, ...] = (),
    tier: bool = True,
    isa: str = "native",
) -> Starter:
    """`make serve`'s command line (a disk tier in a temporary folder, unless not ``tier``)
    on `port`, and ``extra`` flags, in ``isa``'s environment."""
    env = {**os.environ, **ISA_ENVIRONMENTS[isa]}

    def start(port: int) -> subprocess.Popen:
        command = [sys.executable, "-m", "prefixcache.cli", "serve", "--host", "127.0.0.1"]
        command += ["--model", str(model), "--port", str(port), "--threads", str(threads)]
        if tier:
            command += ["--kv-tier", f"disk:{tempfile.mkdtemp(dir=_TIERS.name)}"]
        command += [*([] if caching else ["--no-prefix-caching"]), *extra]
        return subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
        )

    return start


def llama_server(
    binary: Path,
    model: Path,
    threads: int,
    context: int = 36864,
    slots: int = 16,
    extra: tuple[str, ...] = (),
) -> Starter:
    """llama-server with `slots` slots sharing `context` tokens, and ``extra`` flags."""

    def start(port: int) -> subprocess.Popen:
        command = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port)]
        command += ["-t", str(threads), "-tb", str(threads), "-c", str(context), "-np", str(slots)]
        command += extra
        return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    return start


def llama_cpp_python(python: Path, model: Path, threads: int) -> Starter:
    def start(port: int) -> subprocess.Popen:
        launcher = Path(__file__).with_name("llama_cpp_python_server.py")
        command = [str(python), str(launcher), "--model", str(model)]
        command += ["--host", "127.0.0.1", "--port", str(port), "--n_threads", str(threads)]
        command += ["--n_threads_batch", str(threads), "--n_ctx", "4096"]
        return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    return start


class Server:
    """A fresh server for one case: started, timed to healthy, stopped on exit."""

    def __init__(self, peer: Peer) -> None:
        self.port, self.health, start = free_port(), peer.health, peer.start
        self.detokenize = peer.detokenize
        self.url = f"http://127.0.0.1:{self.port}"
        began = time.perf_counter()
        self.process = start(self.port)
        self.startup = self._wait_healthy(began)
        self.model = httpx.get(f"{self.url}/v1/models", timeout=10).json()["data"][0]["id"]

    def _wait_healthy(self, began: float) -> float:
        with httpx.Client(timeout=2) as client:
            while time.perf_counter() - began < 300:
                if self.process.poll() is not None:
                    raise RuntimeError(f"server exited with {self.process.returncode}")
                try:
                    if client.get(f"{self.url}{self.health}").status_code == 200:
                        return time.perf_counter() - began
                except httpx.HTTPError:
                    pass
                time.sleep(0.02)
        raise RuntimeError("server not healthy after 300 s")

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        interrupt(self.process)


def complete(client: httpx.Client, server: Server, prompt: list[int], tokens: int) -> dict:
    """One streamed greedy completion: seconds to the first token and to the last."""
    url = server.url
    text = server.detokenize(prompt) if server.detokenize else prompt
    body = {"model": server.model, "prompt": text, "max_tokens": tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "min_tokens": tokens}  # fmt: skip
    began = time.perf_counter()
    first = last = None
    # A connection per request: llama-server closes a kept-alive one after a stream.
    headers = {"Connection": "close"}
    with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {reply.status_code}: {reply.read()[:300]!r}")
        for line in reply.iter_lines():
            # any chunk with a choice carries a token: one whose text is held back or
            # skipped (a special token, half a character) still counts, in time
            data = line.startswith("data: ") and line != "data: [DONE]"
            if data and json.loads(line[6:]).get("choices"):
                last = time.perf_counter()
                first = first or last
    if first is None:
        raise RuntimeError(f"{url}: no tokens came back")
    return {"ttft": first - began, "total": last - began, "decode": last - first}


def stream_cases(peer: Peer, prompts: Prompts) -> dict:
    """Start-up, one stream's decode speed and short-prompt TTFT, on one fresh server."""
    with Server(peer) as server, httpx.Client(timeout=300) as client:
        complete(client, server, prompts.warm_up, 4)
        rates = []
        for prompt in prompts.decode:
            timing = complete(client, server, prompt, DECODE_TOKENS)
            rates.append((DECODE_TOKENS - 1) / timing["decode"])
        ttfts = [complete(client, server, p, 1)["ttft"] for p in prompts.short]
        prefill = complete(client, server, prompts.long, 1)["ttft"]
        return {
            "startup": server.startup,
            "decode": statistics.median(rates),
            "short_ttft": statistics.median(ttfts),
            "prefill": len(prompts.long) / prefill,
        }


def one_at_a_time(peer: Peer, prompts: Prompts) -> dict:
    with Server(peer) as server, httpx.Client(timeout=300) as client:
        complete(client, server, prompts.warm_up, 2)
        began = time.perf_counter()
        ttfts = [complete(client, server, p, 8)["ttft"] for p in prompts.documents]
        return {"seconds": time.perf_counter() - began, "cached_ttft": statistics.median(ttfts[1:])}


def at_once(peer: Peer, prompts: Prompts) -> dict:
    with Server(peer) as server, httpx.Client(timeout=600, limits=_limits()) as client:
        complete(client, server, prompts.warm_up, 2)
        began = time.perf_counter()
        with ThreadPoolExecutor(len(prompts.documents)) as pool:
            list(pool.map(lambda p: complete(client, server, p, 8), prompts.documents))
        return {"seconds": time.perf_counter() - began}


def _limits() -> httpx.Limits:
    return httpx.Limits(max_connections=32, max_keepalive_connections=32)


def measure(peer: Peer, prompts: Prompts) -> dict:
    return {
        **stream_cases(peer, prompts),
        "one": one_at_a_time(peer, prompts),
        "many": at_once(peer, prompts),
    }


ROWS = (  # label, value, unit, higher is better
    ("start-up to /health", lambda r: r["startup"], "s", False),
    ("decode, one stream", lambda r: r["decode"], "tok/s", True),
    ("short-prompt TTFT", lambda r: r["short_ttft"] * 1e3, "ms", False),
    ("prefill, 2,000 tokens", lambda r: r["prefill"], "tok/s", True),
    ("16 one at a time, total", lambda r: r["one"]["seconds"], "s", False),
    ("  cached-request TTFT p50", lambda r: r["one"]["cached_ttft"] * 1e3, "ms", False),
    ("16 at once, total", lambda r: r["many"]["seconds"], "s", False),
)


def table(results: dict[str, dict]) -> list[str]:
    """One row per case, one column per server, then each of our servers' speed ratio to
    each peer."""
    names = list(results)
    ours = [n for n in names if n.startswith("prefixcache")]
    pairs = [(o, p) for o in ours for p in names if p not in ours]
    head = f"  {'case':<27}" + "".join(f"{n:>17}" for n in names)
    head += "".join(f"{(o.removeprefix('prefixcache') + ' vs ' + p).strip():>26}" for o, p in pairs)
    lines = [head]
    for label, value, unit, higher in ROWS:
        row = f"  {label:<27}" + "".join(f"{value(results[n]):>11.3g} {unit:<5}" for n in names)
        for o, p in pairs:
            mine, theirs = value(results[o]), value(results[p])
            ratio = mine / theirs if higher else theirs / mine
            row += f"{ratio:>25.2f}x"
        lines.append(row)
    return lines


def cpu_line() -> str:
    """The CPU's model name and its vector extensions (they decide which kernels run)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    fields = dict(
        line.split(":", 1) for line in info.splitlines()[:40] if ":" in line and "\t" in line
    )
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    vector = [f for f in fields.get("flags", "").split() if f.startswith(("avx", "amx", "fma"))]
    return f"CPU: {fields.get('model name', 'unknown')}; {' '.join(vector) or 'no AVX'}"


def model_prompts(tokenizer) -> Prompts:
    """The cases' prompts as `tokenizer`'s ids (BOS where the model wants one)."""
    from engine import document_prompts, text

    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    long = tokenizer.encode(text(random.Random(7), PREFILL_TOKENS))
    return Prompts(
        bos + tokenizer.encode("Warm up."),
        [bos + tokenizer.encode(t) for t in DECODE_PROMPTS],
        [bos + tokenizer.encode(t) for t in SHORT_PROMPTS],
        document_prompts(tokenizer),
        (bos + long)[:PREFILL_TOKENS],
    )


def compare(model: Path, threads: int, peer_python: Path, isa: str = "native") -> None:
    """Every case on every server for one model file: the table and what caching buys."""
    from prefixcache.engine.model_files import load_tokenizer

    tokenizer = load_tokenizer(model)
    prompts = model_prompts(tokenizer)
    fp32, int8 = ("--decode-activations", "fp32"), ("--decode-activations", "int8")
    binary = ensure_built(isa)
    servers = {
        "prefixcache": Peer(our_server(model, threads, isa=isa)),
        "prefixcache fp32": Peer(our_server(model, threads, extra=fp32, isa=isa)),
        "prefixcache int8": Peer(our_server(model, threads, extra=int8, isa=isa)),
        "llama-server": Peer(llama_server(binary, model, threads)),
    }
    if peer_python.exists() and isa == "native":  # its server has no /health
        start = llama_cpp_python(peer_python, model, threads)
        servers["llama-cpp-python"] = Peer(start, "/v1/models", tokenizer.decode)
    print(f"\n{model.name}, {threads} threads, one run")
    tokenize_peers.compare(binary, model)  # token ids against llama-server's
    print(f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
    results = {name: measure(peer, prompts) for name, peer in servers.items()}
    print("\n".join(table(results)))
    off = at_once(Peer(our_server(model, threads, caching=False, isa=isa)), prompts)["seconds"]
    on = results["prefixcache"]["many"]["seconds"]
    print(f"  ours, 16 at once: caching off {off:.2f} s, on {on:.2f} s: {off / on:.2f}x")
    print(f"load average after: {os.getloadavg()[0]:.2f}", flush=True)


def build_kernels(isa: str) -> None:
    """Our kernels for ``isa``, built before any server starts (its start-up time is timed),
    and refused unless their decoders are ``isa``'s."""
    ask = "from prefixcache.engine import kernels; kernels.available(); print(kernels.decoders())"
    env = {**os.environ, **ISA_ENVIRONMENTS[isa]}
    said = subprocess.run([sys.executable, "-c", ask], env=env, capture_output=True, text=True)
    if said.stdout.strip() != isa:
        raise RuntimeError(f"kernels for {isa}: decoders {said.stdout.strip()!r} {said.stderr}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="every side")
    parser.add_argument("--peer-python", type=Path, default=PEER_PYTHON)
    parser.add_argument("--model", action="append", help=f"name or GGUF (default: {MODELS})")
    parser.add_argument("--isa", choices=tuple(ISA_ENVIRONMENTS), default="native")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from prefixcache.engine.model_files import model_source

    print("prefixcache vs llama.cpp over HTTP")
    print(cpu_line())
    if args.isa != "native":
        print(f"instructions: {args.isa} only, on both sides (this CPU's cores)")
        build_kernels(args.isa)
    for name in args.model or MODELS:
        compare(model_source(name), args.threads, args.peer_python, args.isa)


if __name__ == "__main__":
    main()
