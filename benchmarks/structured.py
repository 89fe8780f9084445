"""Structured output and tools on the default model: what the grammar costs (issue 23).

1. Mask cost per decode step, at batch 1 and 16: the same prompts decoded free, then
   constrained to a nested JSON schema (greedy, 48 tokens at most). Printed: the median
   step of each, and the time the engine spent computing and applying masks and advancing
   matchers (instrumented: ``constrained.allowed_masks``, ``advance``, ``apply_mask``) as a
   share of the constrained step (goal <= 10%).
2. Schema compile, cold and cached (``GrammarCache``).
3. A tool-calling agent loop through a real ``prefixcache serve`` and the openai SDK: five
   turns (a forced call, the tool's result, the next question), each turn's cached share
   of its prompt tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from prefixcache.engine import engine as engine_module
from prefixcache.engine import sampling
from prefixcache.engine.engine import EngineConfig, LLMEngine
from prefixcache.engine.grammar import GrammarCache
from prefixcache.engine.sampling import SamplingParams
from prefixcache.engine.weights import load_model
from prefixcache.protocol.constraints import JsonOutput, canonical_json

sys.path.insert(0, str(Path(__file__).resolve().parent))
from servers import free_port, wait_healthy

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "role", "tags", "address", "active"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
        },
    },
}
CITIES = ["Paris", "Oslo", "Lima", "Cairo", "Tokyo"]


class MaskClock:
    """Total seconds spent in the engine's grammar work (patched in, restored after)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.saved: list[tuple[object, str, Callable]] = []

    def wrap(self, module: object, name: str) -> None:
        original = getattr(module, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        self.saved.append((module, name, original))
        setattr(module, name, timed)

    def __enter__(self) -> MaskClock:
        self.wrap(engine_module, "allowed_masks")
        self.wrap(engine_module, "advance")
        self.wrap(sampling, "apply_mask")
        return self

    def __exit__(self, *_: object) -> None:
        for module, name, original in self.saved:
            setattr(module, name, original)


def decode_steps(engine: LLMEngine, batch: int, constraint: JsonOutput | None) -> list[float]:
    """Each step's seconds once every request of the batch is decoding."""
    params = SamplingParams(temperature=0, max_tokens=48, constraint=constraint)
    for i in range(batch):
        prompt = engine.tokenizer.encode(f"Describe user number {i} as JSON:")
        engine.add_request(f"r{i}-{time.perf_counter_ns()}", prompt, params)
    steps = []
    while engine.has_unfinished_requests():
        decoding = not engine.scheduler.waiting and all(
            b.seq is not None and b.seq.num_computed_tokens >= b.seq.num_prompt_tokens
            for b in engine.scheduler.running
        )
        start = time.perf_counter()
        engine.step()
        if decoding and len(engine.scheduler.running) == batch:
            steps.append(time.perf_counter() - start)
    return steps


def mask_cost(loaded, batch: int, rounds: int) -> tuple[float, float, float]:
    """Median free step, median constrained step, grammar share of the constrained steps."""
    engine = LLMEngine(loaded, EngineConfig(enable_prefix_caching=False))
    constraint = JsonOutput(canonical_json(SCHEMA))
    decode_steps(engine, batch, constraint)  # warm-up: compiles the grammar once
    free, held, grammar_seconds, held_seconds = [], [], 0.0, 0.0
    for _ in range(rounds):
        free += decode_steps(engine, batch, None)
        with MaskClock() as clock:
            start = time.perf_counter()
            steps = decode_steps(engine, batch, constraint)
            held_seconds += time.perf_counter() - start
        held += steps
        grammar_seconds += clock.seconds
    return statistics.median(free), statistics.median(held), grammar_seconds / held_seconds


def compile_times(tokenizer) -> tuple[float, float]:
    cache = GrammarCache(tokenizer)
    constraint = JsonOutput(canonical_json({**SCHEMA, "title": f"t{time.time_ns()}"}))
    start = time.perf_counter()
    cache.compile(constraint)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    cache.compile(constraint)
    return cold, time.perf_counter() - start


def agent_loop(turns: int) -> list[tuple[int, int]]:
    """(prompt tokens, cached tokens) per turn of a tool loop against a real server."""
    import openai

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "prefixcache.cli", "serve", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_healthy(url)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        messages = [{"role": "system", "content": "You answer weather questions with tools."}]
        usage = []
        for turn in range(turns):
            messages.append({"role": "user", "content": f"Weather in {CITIES[turn % 5]}?"})
            reply = client.chat.completions.create(
                model="SmolLM2-135M-Instruct", messages=messages, tools=[WEATHER],
                tool_choice="required", temperature=0, max_tokens=48,
            )  # fmt: skip
            details = reply.usage.prompt_tokens_details
            usage.append((reply.usage.prompt_tokens, details.cached_tokens if details else 0))
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls or []:
                result = {"temperature": 20 + turn, "unit": json.loads(call.function.arguments)}
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": json.dumps(result)})  # fmt: skip
        return usage
    finally:
        server.terminate()
        server.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--turns", type=int, default=5)
    args = parser.parse_args()
    loaded = load_model()
    print(f"structured-output benchmark, default model, {torch.get_num_threads()} threads")
    for batch in (1, 16):
        free, held, share = mask_cost(loaded, batch, args.rounds)
        print(
            f"  batch {batch:>2}: decode step free {free * 1000:6.2f} ms, constrained "
            f"{held * 1000:6.2f} ms ({held / free:.2f}x); grammar work {share:.1%} of the "
            f"constrained steps (goal <= 10%)"
        )
    cold, cached = compile_times(loaded.tokenizer)
    print(f"  schema compile: cold {cold * 1000:.2f} ms, cached {cached * 1000:.3f} ms")
    for turn, (prompt, cached_tokens) in enumerate(agent_loop(args.turns), 1):
        print(f"  agent loop turn {turn}: {cached_tokens}/{prompt} prompt tokens cached "
              f"({cached_tokens / prompt:.0%})")  # fmt: skip


if __name__ == "__main__":
    main()
