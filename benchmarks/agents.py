"""Agents that pause for tool calls, beside another tenant's flood, with and without retention.

Eight agents share a system prompt and tool list (SYSTEM_TOKENS) and each has its own task
(TASK_TOKENS). A turn sends the whole conversation and generates OUTPUT_TOKENS; the agent
then waits for its "tool" for 2-20 s (uniform) and appends a TOOL_TOKENS result, TURNS
times. Another tenant floods unique FLOOD_TOKENS prompts, Poisson, keeping ``--load`` of
the engine busy: in one pause it computes more tokens than the pool holds, so a
recency-only pool evicts the agents' conversations while they wait.

Three runs, each on a fresh engine and pool, with the same seed (same prompts, pauses and
flood times): the agents alone; with the flood; with the flood and a 5-minute breakpoint
at the end of every agent prompt (``Keep(len(prompt), 300, "5m")``, what /v1/messages does
for ``cache_control: {"type": "ephemeral"}`` on the last block). The agents' tenant may
retain ``--agent-budget`` of the pool (a tenants-file ``retention_budget``).

Printed per run: the agents' hit rate (cached / prompt tokens over every turn, first turns
included), their TTFT p50/p95 (from each turn's submission), the flood's throughput; then
the goals: hit rate with breakpoints >= 90% of the agents-alone run, TTFT p50 <= 1.5x of
it, flood throughput drop <= 10% against the flood run without breakpoints.
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
import time
from dataclasses import dataclass, field

import torch

from prefixcache.cache.retention import Keep
from prefixcache.engine.config import DEFAULT_STEP_TARGET_MS
from prefixcache.engine.engine import EngineConfig, LLMEngine
from prefixcache.engine.sampling import SamplingParams
from prefixcache.engine.weights import load_model

SYSTEM_TOKENS, TASK_TOKENS, TOOL_TOKENS, OUTPUT_TOKENS = 400, 200, 80, 16
FLOOD_TOKENS = 1500
PAUSE_S = (2.0, 20.0)
FIVE_MINUTES = 300.0
VOCAB_LOW, VOCAB_HIGH = 1000, 40000


@dataclass(slots=True)
class Agent:
    name: str
    history: list[int]
    turns_left: int
    rng: random.Random


@dataclass(slots=True)
class Result:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    flood_tokens: int = 0
    flood_span: float = 0.0
    saved_hits: int = 0


def tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(count)]


def make_agents(count: int, turns: int, seed: int) -> list[Agent]:
    rng = random.Random(seed)
    system = tokens(rng, SYSTEM_TOKENS)
    return [
        Agent(f"agent{i}", system + tokens(rng, TASK_TOKENS), turns, random.Random(seed + i + 1))
        for i in range(count)
    ]


def flood_times(span: float, interval: float, seed: int) -> list[float]:
    rng, at, times = random.Random(seed + 1000), 0.0, []
    while at < span:
        at += rng.expovariate(1 / interval)
        times.append(at)
    return times


class Run:
    """One run's event loop: agents' turns and pauses, flood arrivals, engine steps."""

    def __init__(self, engine: LLMEngine, agents: list[Agent], flood: list[float], keep: bool):
        self.engine, self.keep = engine, keep
        self.agents = {agent.name: agent for agent in agents}
        self.ready = [(0.0, agent.name) for agent in agents]  # (when, agent)
        self.flood = list(flood)
        self.flood_rng = random.Random(7)
        self.running: dict[str, tuple[str, float]] = {}  # request id -> (agent, submitted)
        self.result = Result()
        self.flood_first: float | None = None
        self.flood_last = 0.0
        self.start = time.perf_counter()
        self.count = 0
        self.params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
        self.flood_params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def now(self) -> float:
        return time.perf_counter() - self.start

    def go(self) -> Result:
        # as a server's engine thread does: arrivals are taken, and outputs handed on, between
        # the layers of a long prompts' step too
        self.engine.between.arrivals = self.arrive
        self.engine.between.on_outputs = self._outputs
        while self.ready or self.running:
            self.arrive()
            if not self.engine.has_unfinished_requests():
                time.sleep(0.005)
                continue
            self._outputs(self.engine.step())
        self.result.flood_span = self.flood_last - (self.flood_first or 0.0)
        self.result.saved_hits = self.engine.manager.stats.retention_saved_hits
        return self.result

    def arrive(self) -> None:
        """Add the agents' turns and flood prompts whose time has come."""
        now = self.now()
        while self.ready and self.ready[0][0] <= now:
            _, name = heapq.heappop(self.ready)
            self.count += 1
            self._submit(self.agents[name], f"{name}-{self.count}", self.params)
        while self.flood and self.flood[0] <= now:
            self.flood.pop(0)
            self.count += 1
            self.engine.add_request(
                f"flood-{self.count}", tokens(self.flood_rng, FLOOD_TOKENS), self.flood_params,
                cache_salt="flood", owner="flood",
            )  # fmt: skip

    def _outputs(self, outputs: list) -> None:
        for output in outputs:
            if output.finished:
                self._finished(output)

    def _submit(self, agent: Agent, request_id: str, params: SamplingParams) -> None:
        keeps = (Keep(len(agent.history), FIVE_MINUTES, "5m"),) if self.keep else ()
        self.engine.add_request(
            request_id, agent.history, params, cache_salt="agents", owner="agents",
            retention=keeps,
        )  # fmt: skip
        self.running[request_id] = (agent.name, time.perf_counter())

    def _finished(self, output) -> None:
        if output.request_id.startswith("flood-"):
            now = self.now()
            if self.flood_first is None:
                self.flood_first = now
            self.flood_last = now
            self.result.flood_tokens += len(output.prompt_token_ids) + len(output.token_ids)
            return
        name, submitted = self.running.pop(output.request_id)
        agent = self.agents[name]
        self.result.prompt_tokens += len(output.prompt_token_ids)
        self.result.cached_tokens += output.num_cached_tokens
        self.result.ttfts.append(output.metrics.first_token_time - submitted)
        agent.turns_left -= 1
        if agent.turns_left:
            agent.history = agent.history + output.token_ids + tokens(agent.rng, TOOL_TOKENS)
            heapq.heappush(self.ready, (self.now() + agent.rng.uniform(*PAUSE_S), name))


def prefill_seconds(loaded, args: argparse.Namespace) -> float:
    """One FLOOD_TOKENS prefill alone (after a warm-up), in seconds."""
    engine = make_engine(loaded, args)
    rng = random.Random(99)
    for attempt in range(2):
        start = time.perf_counter()
        engine.add_request(
            f"warm{attempt}", tokens(rng, FLOOD_TOKENS), SamplingParams(max_tokens=1)
        )
        while engine.has_unfinished_requests():
            engine.step()
        seconds = time.perf_counter() - start
    return seconds


def make_engine(loaded, args: argparse.Namespace) -> LLMEngine:
    config = EngineConfig(
        num_kv_blocks=args.pool_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens,
        retention_budgets={"agents": args.agent_budget},
        step_target_ms=args.step_target_ms or None,
    )
    return LLMEngine(loaded, config)


def p95(values: list[float]) -> float:
    return sorted(values)[int(0.95 * (len(values) - 1))]


def line(name: str, result: Result) -> str:
    text = (
        f"  {name:<24} agents hit {result.cached_tokens / result.prompt_tokens:6.1%}   TTFT p50"
        f" {statistics.median(result.ttfts):6.3f}s p95 {p95(result.ttfts):6.3f}s"
    )
    if result.flood_tokens:
        text += f"   flood {result.flood_tokens / result.flood_span:7.1f} tok/s"
    return text + f"   saved hits {result.saved_hits}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--turns", type=int, default=5, help="turns per agent")
    parser.add_argument("--load", type=float, default=0.5, help="the flood's share of the engine")
    parser.add_argument("--pool-blocks", type=int, default=512, help="KV pool, 16-token blocks")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--agent-budget", type=float, default=0.8, help="agents' retention share")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--step-target-ms", type=float, default=DEFAULT_STEP_TARGET_MS,
        help="the scheduler's step target (0: the token budget alone, as before issue 36)",
    )  # fmt: skip
    args = parser.parse_args()
    loaded = load_model()
    interval = prefill_seconds(loaded, args) / args.load
    span = args.turns * (PAUSE_S[1] + 2.0)
    results = {}
    for name, flood, keep in (("agents alone", False, False), ("flood", True, False),
                              ("flood + 5m breakpoints", True, True)):  # fmt: skip
        engine = make_engine(loaded, args)
        arrivals = flood_times(span, interval, args.seed) if flood else []
        results[name] = Run(
            engine, make_agents(args.agents, args.turns, args.seed), arrivals, keep
        ).go()
        engine.manager.check_invariants()
    print(
        f"agents benchmark, default model, {torch.get_num_threads()} threads; pool "
        f"{args.pool_blocks} blocks of 16; {args.agents} agents x {args.turns} turns (system "
        f"{SYSTEM_TOKENS} + task {TASK_TOKENS} tokens, +{OUTPUT_TOKENS} out +{TOOL_TOKENS} tool "
        f"result per turn, pauses {PAUSE_S[0]:g}-{PAUSE_S[1]:g} s); flood: unique "
        f"{FLOOD_TOKENS}-token prompts every {interval:.2f}s on average (load {args.load:g}); "
        f"agents' retention budget {args.agent_budget:g} of the pool; at most "
        f"{args.max_num_batched_tokens} tokens a step, step target "
        f"{args.step_target_ms or 'none'} ms"
    )
    for name, result in results.items():
        print(line(name, result))
    alone, flood, kept = (results[n] for n in ("agents alone", "flood", "flood + 5m breakpoints"))

    def hit(result: Result) -> float:
        return result.cached_tokens / result.prompt_tokens

    print(f"  agents hit rate, breakpoints / alone: {hit(kept) / hit(alone):.1%} (goal >= 90%);"
          f" without breakpoints / alone: {hit(flood) / hit(alone):.1%}")  # fmt: skip
    ttft = statistics.median(kept.ttfts) / statistics.median(alone.ttfts)
    ttft_flood = statistics.median(flood.ttfts) / statistics.median(alone.ttfts)
    print(f"  agents TTFT p50, breakpoints / alone: {ttft:.2f}x (goal <= 1.5x);"
          f" without breakpoints / alone: {ttft_flood:.2f}x")  # fmt: skip
    change = (kept.flood_tokens / kept.flood_span) / (flood.flood_tokens / flood.flood_span) - 1
    print(f"  flood throughput, breakpoints vs none: {change:+.1%} (goal: drop <= 10%)")


if __name__ == "__main__":
    main()
