"""llguidance vs xgrammar on the default model's vocabulary (issue 23: picking the library).

For each library: the vocabulary setup, one realistic JSON schema's compile (cold, then
cached), and the per-token mask over a valid document fed token by token (mask fill into a
bitmask, then the token consumed). Prints both libraries' numbers and xgrammar/llguidance.
xgrammar is optional: without it only llguidance is measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string"},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "scores": {"type": "array", "items": {"type": "number"}},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "address", "scores", "active"],
    "additionalProperties": False,
}
DOCUMENT = {
    "name": "Ada Lovelace",
    "age": 36,
    "role": "editor",
    "tags": ["math", "engines", "poetry"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "SW1Y 4JH"},
    "scores": [9.5, 8.25, 10],
    "active": True,
}


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer) -> None:
        import llguidance

        self.lib = llguidance
        self.tokenizer = tokenizer

    def setup(self) -> None:
        from prefixcache.engine.grammar import llg_tokenizer

        llg_tokenizer.cache_clear()
        self.ll_tokenizer = llg_tokenizer(self.tokenizer)

    def compile(self, schema: str) -> object:
        grammar = self.lib.LLMatcher.grammar_from_json_schema(schema)
        matcher = self.lib.LLMatcher(self.ll_tokenizer, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def steps(self, compiled: object, tokens: list[int]) -> list[float]:
        from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

        matcher = self.lib.LLMatcher(self.ll_tokenizer, compiled)
        bitmask = allocate_token_bitmask(1, self.tokenizer.vocab_size)
        times = []
        for token in tokens:
            started = time.perf_counter()
            fill_next_token_bitmask(matcher, bitmask, 0)
            assert matcher.consume_token(token), matcher.get_error()
            times.append(time.perf_counter() - started)
        assert matcher.is_accepting()
        return times


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer) -> None:
        import xgrammar

        self.lib = xgrammar
        self.tokenizer = tokenizer

    def setup(self) -> None:
        vocab = [self.tokenizer.token_bytes(i) for i in range(self.tokenizer.vocab_size)]
        info = self.lib.TokenizerInfo(
            vocab,
            vocab_type=self.lib.VocabType.RAW,
            vocab_size=self.tokenizer.vocab_size,
            stop_token_ids=list(self.tokenizer.eos_token_ids),
        )
        self.compiler = self.lib.GrammarCompiler(info, max_threads=1)

    def compile(self, schema: str) -> object:
        return self.compiler.compile_json_schema(schema)

    def steps(self, compiled: object, tokens: list[int]) -> list[float]:
        matcher = self.lib.GrammarMatcher(compiled)
        bitmask = self.lib.allocate_token_bitmask(1, self.tokenizer.vocab_size)
        times = []
        for token in tokens:
            started = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask, 0)
            assert matcher.accept_token(token)
            times.append(time.perf_counter() - started)
        return times


def measure(library, tokens: list[int], rounds: int) -> dict[str, float]:
    """Setup, cold and cached compile, mean and p99 per-token mask step, in ms."""
    setup, _ = timed(library.setup)
    schema = json.dumps(SCHEMA)
    cold, compiled = timed(lambda: library.compile(schema))
    cached = min(timed(lambda: library.compile(schema))[0] for _ in range(3))
    steps = [t for _ in range(rounds) for t in library.steps(compiled, tokens)]
    steps.sort()
    return {
        "setup_ms": setup * 1e3,
        "compile_cold_ms": cold * 1e3,
        "compile_cached_ms": cached * 1e3,
        "mask_mean_ms": statistics.fmean(steps) * 1e3,
        "mask_p99_ms": steps[int(0.99 * (len(steps) - 1))] * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="documents fed per library")
    args = parser.parse_args()
    from engine_fixtures import default_tokenizer

    tokenizer = default_tokenizer()
    tokens = tokenizer.encode(json.dumps(DOCUMENT))
    print(f"vocab {tokenizer.vocab_size}, document {len(tokens)} tokens, rounds {args.rounds}")
    results = {}
    for make in (LLGuidance, XGrammar):
        try:
            library = make(tokenizer)
        except ImportError:
            print(f"{make.name}: not installed, skipped")
            continue
        results[make.name] = measure(library, tokens, args.rounds)
    for name, numbers in results.items():
        print(name.ljust(11), "  ".join(f"{k} {v:9.3f}" for k, v in numbers.items()))
    if len(results) == 2:
        ll, xg = results["llguidance"], results["xgrammar"]
        print("xgrammar/llguidance", "  ".join(f"{k} {xg[k] / ll[k]:6.2f}" for k in ll))


if __name__ == "__main__":
    main()
