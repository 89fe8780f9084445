"""Hybrid KV on Gemma 3 (issue 35): multi-turn chats at a KV budget a quarter of the
working set, over HTTP, against llama-server on the same GGUF. One run; the CPU line first.

Workload (the same text to every server, `/v1/completions`, streamed, greedy, EOS ignored):
a shared ~1,500-token system prompt, then `--conversations` chats of `--turns` turns; each
turn appends a new ~`--user-tokens`-token user message (seeded synthetic text) and the
model's `--answer-tokens`-token answer (the returned text, exactly), so chats grow to
2-4k tokens. `--clients` threads run the chats turn by turn (`--order turns`, the default:
every chat's turn t before any chat's turn t+1, so a chat comes back after all the others, as
users who read and type between turns), or each chat to its end (`--order chats`).

KV budget: a quarter (`--kv-share`) of the working set (every chat's final length, from the
plan) in the all-full float32 layout (layers x 2 x KV heads x head_dim x 4 bytes a token,
read from the GGUF); raised, and said so, if the longest chat would not fit. Ours, each on
a fresh `prefixcache serve --kv-cache-bytes BUDGET` (no second tier: a hybrid pool has
none): (full, float32), (hybrid, float32), (hybrid, bfloat16), (hybrid, int8). For each:
the hit rate of later turns (turns >= 2: cached prompt tokens / prompt tokens, from
`usage.prompt_tokens_details.cached_tokens`), their TTFT p50, the wall time, decode tok/s
(answer tokens after the first over their stream time), and the server's RSS (VmRSS of it
and its children, read after the last turn); for a hybrid pool, its window counters after
the chats from /metrics (pages released and evicted, prompt tokens recomputed for the
windows, the pool's bytes per cached token summed over its groups).

KV bytes per cached token at 8k context: after the chats, one `--probe-tokens` prompt on
the idle server (if it fits the budget); halfway through its 16 tokens out, `/metrics` gives
the pool's pages held (kv_blocks - kv_free_blocks: only the probe is live), times a page's
bytes (its layers from the layout:
every layer for `full`, the full-attention layers' count for `hybrid`), over the context.
Printed beside the analytical value (all-full: layers x 2 x KV heads x row bytes, an int8
row head_dim + 4; hybrid: the full layers for every token, the window groups' layers for
min(T, window + block) of T). Goals: hybrid <= 0.3x all-full float32, bfloat16 <= 0.15x,
int8 <= 0.08x; hybrid vs all-full at one budget: later turns' hit rate >= 2x, TTFT p50 at
least 2x lower; bfloat16 and int8 decode no slower than float32.

llama-server (benchmarks/llama_server.py), same chats: its default SWA cache, then
`--swa-full`. `-np` = `--clients` (a slot a client); `-c` = the tokens our budget holds
all-full at f16 (18,432 bytes a token on this model), so its full-attention layers hold
what our budget would in llama.cpp's default KV type; raised to clients x the longest chat
if smaller, since `-np` slots split `-c`. Its RAM prompt cache (`--cache-ram`, 8 GiB by
default) is left as it ships unless `--llama-cache-ram` says otherwise: its RSS shows it.
Cached tokens from its final chunk's `usage.prompt_tokens_details.cached_tokens`
(`timings.cache_n` where usage is absent).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from engine import text
from llama_server import ensure_built
from peers import Peer, Server, complete, cpu_line, llama_server, our_server
from prefixcache.cache.common import DEFAULT_BLOCK_SIZE, cdiv
from prefixcache.engine.kv_store import KV_DTYPES, row_bytes

CONFIGS = (("full", "float32"), ("hybrid", "float32"), ("hybrid", "bfloat16"), ("hybrid", "int8"))
PROBE_OUT = 16  # tokens the probe decodes; /metrics is read at the half (its windows slid)
GOALS = {"float32": 0.3, "bfloat16": 0.15, "int8": 0.08}  # hybrid over all-full float32


@dataclass(frozen=True)
class KVShape:
    """What sizes a token's KV: read from the GGUF."""

    layers: int
    kv_heads: int
    head_dim: int
    window: int
    window_layers: int

    def full_bytes(self, dtype: str) -> int:
        """One token in every layer, K and V (int8: scales too)."""
        return self.layers * 2 * self.kv_heads * row_bytes(self.head_dim, KV_DTYPES[dtype])

    def page_layers(self, layout: str) -> int:
        """Layers a page holds: every one (full), or the full-attention layers (hybrid)."""
        return self.layers - self.window_layers if layout == "hybrid" else self.layers

    def page_bytes(self, layout: str, dtype: str) -> int:
        """One page: a block's tokens in the page's layers."""
        return self.page_layers(layout) * DEFAULT_BLOCK_SIZE * self.full_bytes(dtype) // self.layers

    def hybrid_bytes(self, dtype: str, context: int) -> float:
        """Analytical bytes a cached token at `context`: full layers for every token, each
        window group's (padded) layers for the window and one block."""
        page = self.page_layers("hybrid")
        padded = cdiv(self.window_layers, page) * page
        share = (page + padded * min(context, self.window + DEFAULT_BLOCK_SIZE) / context) / (
            self.layers
        )
        return share * self.full_bytes(dtype)


def kv_shape(model: Path) -> KVShape:
    from prefixcache.engine.model_files import gguf_metadata, open_gguf
    from prefixcache.engine.models.family import GgufFields
    from prefixcache.engine.models.gemma3 import window_layers

    meta = gguf_metadata(open_gguf(model), model)
    fields = GgufFields(meta, {}, meta["general.architecture"], model)
    window = int(fields.get("attention.sliding_window", 0))
    flags = window_layers(fields) if window else ()
    heads = fields.number("attention.head_count")
    return KVShape(
        layers=fields.number("block_count"),
        kv_heads=int(fields.get("attention.head_count_kv", heads)),
        head_dim=int(
            fields.get("attention.key_length", fields.number("embedding_length") // heads)
        ),
        window=window,
        window_layers=sum(flags),
    )


@dataclass(frozen=True)
class Plan:
    """The chats: a system prompt, each chat's user messages, and their token counts."""

    warm_up: list[int]  # token ids, sharing no prefix with the chats
    system: str
    chats: list[list[str]]
    answer_tokens: int
    final_lengths: list[int]  # each chat's last prompt and answer, estimated
    system_tokens: int

    @property
    def working_set(self) -> int:
        return sum(self.final_lengths)


def user_turn(message: str) -> str:
    return f"\n\nUser: {message}\nAssistant:"


def make_plan(tokenizer, args: argparse.Namespace) -> Plan:
    """Seeded synthetic text sized by `tokenizer` (the chat's tokens, answers estimated)."""
    rng = random.Random(35)

    def words(tokens: int, head: str) -> str:
        body = head
        while len(tokenizer.encode(body)) < tokens:
            body += " " + text(rng, 8)
        return body

    system = words(args.system_tokens, "System: you answer questions about caches.")
    chats = [
        [words(args.user_tokens, f"Chat {c}, question {t + 1}:") for t in range(args.turns)]
        for c in range(args.conversations)
    ]
    base = len(tokenizer.encode(system))
    lengths = [
        base + sum(len(tokenizer.encode(user_turn(m))) + args.answer_tokens for m in chat)
        for chat in chats
    ]
    warm_up = bos_ids(tokenizer) + tokenizer.encode("Warm up.")
    return Plan(warm_up, system, chats, args.answer_tokens, lengths, base)


def bos_ids(tokenizer) -> list[int]:
    return [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []


def stream_turn(client: httpx.Client, server: Server, prompt: str, tokens: int) -> dict:
    """One streamed greedy turn: its text, TTFT, decode time and cached prompt tokens."""
    body = {"model": server.model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "min_tokens": tokens,
            "stream_options": {"include_usage": True}}  # fmt: skip
    began, times, parts, usage, timings = time.perf_counter(), [], [], None, None
    headers = {"Connection": "close"}  # llama-server closes a kept-alive one after a stream
    with client.stream("POST", f"{server.url}/v1/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{server.url}: HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage, timings = chunk.get("usage") or usage, chunk.get("timings") or timings
            if chunk.get("choices"):
                times.append(time.perf_counter())
                parts.append(chunk["choices"][0].get("text") or "")
    if not times or usage is None:
        raise RuntimeError(f"{server.url}: no tokens or no usage came back")
    return {
        "text": "".join(parts),
        "ttft": times[0] - began,
        "decode": times[-1] - times[0],
        "answer": usage.get("completion_tokens", tokens),
        **cached_counts(usage, timings),
    }


def cached_counts(usage: dict, timings: dict | None) -> dict:
    """Prompt and cached tokens: usage's details, else llama-server's timings."""
    details = usage.get("prompt_tokens_details") or {}
    if "cached_tokens" in details:
        cached = details["cached_tokens"]
        return {"prompt": usage["prompt_tokens"], "cached": cached, "source": "usage"}
    if timings is None:
        raise RuntimeError("the reply has neither cached_tokens nor timings")
    cached = timings["cache_n"]
    return {"prompt": cached + timings["prompt_n"], "cached": cached, "source": "cache_n"}


class Chat:
    """One chat's prompt so far; each turn appends a user message and the answer as returned."""

    def __init__(self, plan: Plan, index: int) -> None:
        self.plan, self.index, self.prompt, self.turns = plan, index, plan.system, []

    def next_turn(self, client: httpx.Client, server: Server) -> None:
        number = len(self.turns) + 1
        self.prompt += user_turn(self.plan.chats[self.index][number - 1])
        turn = stream_turn(client, server, self.prompt, self.plan.answer_tokens)
        self.prompt += turn.pop("text")
        self.turns.append({**turn, "turn": number})

    def run(self, client: httpx.Client, server: Server) -> None:
        """Every turn in order."""
        for _ in self.plan.chats[self.index]:
            self.next_turn(client, server)


def run_workload(server: Server, plan: Plan, clients: int, order: str) -> dict:
    """The chats on `clients` threads: chat by chat (`chats`), or turn by turn across every
    chat (`turns`: each chat's next turn comes after every other chat's, as users who read
    and type between turns)."""
    limits = httpx.Limits(max_connections=2 * clients + 4)
    chats = [Chat(plan, index) for index in range(len(plan.chats))]
    with httpx.Client(timeout=1800, limits=limits) as client, ThreadPoolExecutor(clients) as pool:
        complete(client, server, plan.warm_up, 2)
        began = time.perf_counter()
        if order == "chats":
            list(pool.map(lambda chat: chat.run(client, server), chats))
        else:
            for _ in range(len(plan.chats[0])):
                list(pool.map(lambda chat: chat.next_turn(client, server), chats))
        wall = time.perf_counter() - began
    turns = [t for chat in chats for t in chat.turns]
    return {"turns": turns, "wall": wall, "system": plan.system_tokens}


def rss_bytes(pid: int) -> int:
    """VmRSS of `pid` and every process under it."""
    total, todo = 0, [pid]
    parents = _parents()
    while todo:
        current = todo.pop()
        status = Path(f"/proc/{current}/status")
        if status.exists():
            found = re.search(r"VmRSS:\s+(\d+) kB", status.read_text())
            total += int(found.group(1)) * 1024 if found else 0
        todo += [child for child, parent in parents.items() if parent == current]
    return total


def _parents() -> dict[int, int]:
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    return parents


def metric(page: str, name: str) -> float:
    """The first sample of `name` (a counter's `_total` too) in a /metrics page."""
    found = re.search(rf"^{name}(?:_total)?(?:{{[^}}]*}})? (\S+)$", page, re.MULTILINE)
    if found is None:
        raise RuntimeError(f"/metrics has no {name}")
    return float(found.group(1))


def window_state(server: Server) -> dict | None:
    """A hybrid pool's window counters and its bytes per cached token (the sum of its
    groups'), from /metrics; None for an all-full pool."""
    page = httpx.get(f"{server.url}/metrics", timeout=30).text
    groups = re.findall(r"^prefixcache_kv_bytes_per_cached_token{[^}]*} (\S+)$", page, re.M)
    if not groups:
        return None
    names = ("released", "evicted")
    state = {n: int(metric(page, f"prefixcache_kv_window_pages_{n}")) for n in names}
    state["lost"] = int(metric(page, "prefixcache_kv_window_lost_tokens"))
    return {**state, "per_token": sum(float(value) for value in groups)}


def probe(server: Server, prompt: list[int], page_bytes: int, budget: int) -> float:
    """Bytes a cached token: the pages a lone `prompt` holds mid-decode, over its length.
    RuntimeError if the pool's size says its pages are not `page_bytes` (another layout)."""
    body = {"model": server.model, "prompt": prompt, "max_tokens": PROBE_OUT, "temperature": 0,
            "stream": True, "ignore_eos": True, "min_tokens": PROBE_OUT}  # fmt: skip
    held, chunks = None, 0
    url = f"{server.url}/v1/completions"
    with httpx.Client(timeout=1800) as client, client.stream("POST", url, json=body) as reply:
        for line in reply.iter_lines():
            chunks += line.startswith("data: ") and line != "data: [DONE]"
            if held is None and chunks == PROBE_OUT // 2:
                page = client.get(f"{server.url}/metrics").text
                pages = metric(page, "prefixcache_kv_blocks")
                held = pages - metric(page, "prefixcache_kv_free_blocks")
    if held is None:
        raise RuntimeError(f"{server.url}: the probe returned nothing")
    if pages != budget // page_bytes:
        raise RuntimeError(f"{pages:.0f} pages in {budget:,} B: not {page_bytes:,} B a page")
    return held * page_bytes / len(prompt)


def measure_ours(setup: dict, layout: str, dtype: str) -> dict:
    shape, budget = setup["shape"], setup["budget"]
    extra = ["--kv-cache-bytes", str(budget), "--kv-cache-dtype", dtype]
    extra += ["--kv-layout", layout]
    start = our_server(setup["model"], setup["threads"], extra=tuple(extra), tier=False)
    with Server(Peer(start)) as server:
        result = run_workload(server, setup["plan"], setup["clients"], setup["order"])
        result["rss"] = rss_bytes(server.process.pid)
        result["windows"] = window_state(server)
        result["per_token"], result["probe_note"] = None, "no probe"
        tokens = len(setup["probe"])
        if tokens and (tokens + PROBE_OUT) * shape.full_bytes(dtype) > budget:
            result["probe_note"] = "the probe does not fit the budget"
        elif tokens:
            page = shape.page_bytes(layout, dtype)
            try:
                result["per_token"] = probe(server, setup["probe"], page, budget)
            except (RuntimeError, httpx.HTTPError) as error:
                result["probe_note"] = f"probe failed: {error}"
    return result


def window_line(name: str, windows: dict) -> str:
    return (
        f"    {name}: after the chats, window pages released {windows['released']:,}, "
        f"evicted {windows['evicted']:,}; prompt tokens recomputed for the windows "
        f"{windows['lost']:,}; pool bytes per cached token {windows['per_token']:,.0f} B"
    )


def measure_llama(setup: dict, swa_full: bool) -> dict:
    extra = ("--swa-full",) if swa_full else ()
    if setup["cache_ram"] is not None:
        extra += ("--cache-ram", str(setup["cache_ram"]))
    start = llama_server(
        ensure_built(), setup["model"], setup["threads"], setup["context"], setup["clients"], extra
    )
    with Server(Peer(start)) as server:
        result = run_workload(server, setup["plan"], setup["clients"], setup["order"])
        result["rss"] = rss_bytes(server.process.pid)
    return result


def later(result: dict) -> dict:
    """Hit rate and TTFT p50 of turns >= 2 (and the hit rate of their own history: the
    tokens past the shared system prompt); decode tok/s over every answer."""
    turns = [t for t in result["turns"] if t["turn"] >= 2] or result["turns"]
    decode, system = sum(t["decode"] for t in result["turns"]), result["system"]
    own = sum(max(0, t["cached"] - system) for t in turns)
    return {
        "hit": sum(t["cached"] for t in turns) / max(1, sum(t["prompt"] for t in turns)),
        "own": own / max(1, sum(t["prompt"] - system for t in turns)),
        "ttft": statistics.median(t["ttft"] for t in turns),
        "decode": sum(t["answer"] - 1 for t in result["turns"]) / max(decode, 1e-9),
    }


def row(name: str, result: dict) -> str:
    summary = later(result)
    return (
        f"  {name:<28} later-turn hits {summary['hit']:6.1%} (own history "
        f"{summary['own']:6.1%})  TTFT p50 "
        f"{summary['ttft'] * 1e3:7.0f} ms  wall {result['wall']:6.1f} s  decode "
        f"{summary['decode']:5.1f} tok/s  RSS {result['rss'] / 2**20:6.0f} MiB  (cached: "
        f"{'/'.join(sorted({t['source'] for t in result['turns']}))})"
    )


def bytes_lines(setup: dict, ours: dict[tuple[str, str], dict]) -> list[str]:
    """Hybrid bytes a cached token per dtype, measured and analytical, against all-full."""
    shape, context = setup["shape"], len(setup["probe"]) or 8192
    base = shape.full_bytes("float32")
    lines = [
        f"KV bytes per cached token at {context:,} tokens of context (measured: pages held "
        "mid-decode, from /metrics, x a page's bytes, over the context; analytical: from the "
        f"layout; ratios of the measured value where there is one; all-full float32 {base:,} B):"
    ]
    for dtype in GOALS:
        result, model = ours[("hybrid", dtype)], shape.hybrid_bytes(dtype, context)
        value = result["per_token"] or model
        seen = f"{result['per_token']:9,.0f} B" if result["per_token"] else "      n/a"
        lines.append(
            f"  hybrid {dtype:<9} measured {seen}, analytical {model:9,.0f} B: "
            f"{value / base:.3f}x all-full float32 (goal <= {GOALS[dtype]}x), "
            f"{value / shape.full_bytes(dtype):.3f}x all-full {dtype}"
        )
    full = ours[("full", "float32")]
    seen = f"{full['per_token']:9,.0f} B" if full["per_token"] else "      n/a"
    lines.append(f"  all-full float32  measured {seen}, analytical {base:9,} B")
    return lines + [
        f"  {layout} {dtype}: {result['probe_note']}"
        for (layout, dtype), result in ours.items()
        if not result["per_token"]
    ]


def ratio_lines(ours: dict, peers: dict) -> list[str]:
    hybrid, full = later(ours[("hybrid", "float32")]), later(ours[("full", "float32")])
    lines = [
        f"hybrid vs all-full float32, same budget: later-turn hit rate "
        f"{hybrid['hit'] / max(full['hit'], 1e-9):.2f}x (goal >= 2x), TTFT p50 "
        f"{full['ttft'] / hybrid['ttft']:.2f}x lower (goal >= 2x); own-history hit rate "
        f"{hybrid['own']:.1%} vs {full['own']:.1%}"
    ]
    rates = {dtype: later(ours[("hybrid", dtype)])["decode"] for dtype in GOALS}
    lines.append(
        "decode, hybrid: "
        + ", ".join(f"{d} {r / rates['float32']:.2f}x float32" for d, r in rates.items())
        + " (goal: bfloat16 and int8 >= 1.00x)"
    )
    for name, result in peers.items():
        theirs = later(result)
        lines.append(
            f"hybrid float32 vs {name}: later-turn hit rate {hybrid['hit']:.1%} vs "
            f"{theirs['hit']:.1%}, TTFT p50 {theirs['ttft'] / hybrid['ttft']:.2f}x lower, "
            f"RSS {ours[('hybrid', 'float32')]['rss'] / result['rss']:.2f}x theirs"
        )
    return lines


def budget_for(plan: Plan, shape: KVShape, share: float) -> tuple[int, str]:
    """`share` of the working set all-full float32, or the longest chat if that is more."""
    per_token = shape.full_bytes("float32")
    budget = int(plan.working_set * share) * per_token
    least = (max(plan.final_lengths) + 2 * DEFAULT_BLOCK_SIZE) * per_token
    if budget >= least:
        return budget, f"{share:.0%} of the working set all-full float32"
    return least, "raised from a share of the working set to hold the longest chat"


def llama_context(plan: Plan, shape: KVShape, budget: int, clients: int) -> tuple[int, str]:
    """Tokens `budget` holds all-full at f16, or clients x the longest chat if more."""
    tokens = budget // (shape.layers * 2 * shape.kv_heads * shape.head_dim * 2)
    least = clients * (max(plan.final_lengths) + 64)
    if tokens >= least:
        return tokens, "our budget's tokens all-full at f16"
    return least, "raised to clients x the longest chat (slots split -c)"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="gemma3-270m", help="name or GGUF")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="every side")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=1500)
    parser.add_argument("--user-tokens", type=int, default=200)
    parser.add_argument("--answer-tokens", type=int, default=24)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument(
        "--order", choices=("turns", "chats"), default="turns",
        help="turns: every chat's turn t before any turn t+1; chats: each chat to its end",
    )  # fmt: skip
    parser.add_argument("--kv-share", type=float, default=0.25, help="of the working set")
    parser.add_argument("--probe-tokens", type=int, default=8192, help="0: no probe")
    parser.add_argument("--no-peer", action="store_true", help="skip llama-server")
    parser.add_argument("--llama-cache-ram", type=int, help="its --cache-ram, MiB")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    from prefixcache.engine.model_files import load_tokenizer, model_source

    model = model_source(args.model)
    tokenizer = load_tokenizer(model)
    shape, plan = kv_shape(model), make_plan(tokenizer, args)
    budget, why = budget_for(plan, shape, args.kv_share)
    context, context_why = llama_context(plan, shape, budget, args.clients)
    words = tokenizer.encode(text(random.Random(8), args.probe_tokens))
    probe_ids = (bos_ids(tokenizer) + words)[: args.probe_tokens]
    print("issue 35: hybrid KV on multi-turn chats at a quarter of the working set, over HTTP")
    print(cpu_line())
    print(
        f"{model.name}, {args.threads} threads, one run; {args.conversations} chats x "
        f"{args.turns} turns ({args.order} first), {args.clients} clients; system "
        f"{args.system_tokens}, user {args.user_tokens}, answer {args.answer_tokens} tokens; "
        f"working set {plan.working_set:,} tokens (chats {min(plan.final_lengths):,}-"
        f"{max(plan.final_lengths):,}); KV budget {budget:,} B ({why}); "
        f"load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    setup = {"model": model, "threads": args.threads, "shape": shape, "plan": plan,
             "budget": budget, "clients": args.clients, "probe": probe_ids,
             "context": context, "cache_ram": args.llama_cache_ram,
             "order": args.order}  # fmt: skip
    ours = {}
    for layout, dtype in CONFIGS:
        result = ours[(layout, dtype)] = measure_ours(setup, layout, dtype)
        print(row(f"prefixcache {layout} {dtype}", result), flush=True)
        if result["windows"]:
            print(window_line(f"{layout} {dtype}", result["windows"]), flush=True)
    peers = {}
    if not args.no_peer:
        print(f"llama-server: -c {context:,} ({context_why}), -np {args.clients}")
        for name, swa_full in (("llama-server", False), ("llama-server --swa-full", True)):
            peers[name] = measure_llama(setup, swa_full)
            print(row(name, peers[name]), flush=True)
    print("\n".join(bytes_lines(setup, ours) + ratio_lines(ours, peers)))
    print(f"load average after: {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
