"""Cascade (shared-prefix) attention: one engine step with and without it, in one process.

SmolLM2-135M-shaped model with random weights, block size 16, KV filled with noise:
  (a) one decode step of 64 sequences sharing a 1,500-token prefix + 70-90 own tokens each;
  (b) one step of 64 suffix prefills of 76 tokens after a shared 1,488-token prefix;
  (c) one decode step of 32 unrelated ~600-token sequences (no sharing: must not slow down).
Each step (metadata build + 30-layer forward + logits of the last rows) runs alternately with
`share_prefixes=True` and `False`; minimum and median of the repetitions are shown. Then
one decode step of transformers' LlamaForCausalLM (DynamicCache, 1,580 tokens), for scale.
`--threshold` runs only the attention-only sweep behind `MIN_SHARED_BLOCKS` instead.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers

from prefixcache.engine.attention import AttentionMetadata, paged_attention
from prefixcache.engine.config import ModelConfig
from prefixcache.engine.kv_store import KVStore
from prefixcache.engine.models.llama import LlamaModel

BLOCK = 16
NUM_BLOCKS = 1400
CONFIG = ModelConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)


@dataclass
class Step:
    """One engine step's batch: what `AttentionMetadata.build` receives."""

    name: str
    query_lens: list[int]
    context_lens: list[int]
    tables: list[list[int]]


class Blocks:
    """Hands out distinct physical block ids in a shuffled order, like a used pool."""

    def __init__(self, seed: int) -> None:
        self.free = list(range(NUM_BLOCKS))
        random.Random(seed).shuffle(self.free)

    def take(self, n: int) -> list[int]:
        taken, self.free = self.free[:n], self.free[n:]
        assert len(taken) == n, "pool too small"
        return taken


def shared_step(name: str, prefix: int, own: list[int], query_len: int | None) -> Step:
    """Sequences whose first `prefix // BLOCK` blocks are shared; `own[i]` tokens follow."""
    blocks = Blocks(seed=len(own))
    shared = blocks.take(prefix // BLOCK)
    contexts = [prefix + n for n in own]
    tables = [shared + blocks.take(-(-c // BLOCK) - len(shared)) for c in contexts]
    queries = [1 if query_len is None else query_len for _ in own]
    return Step(name, queries, contexts, tables)


def unrelated_step(name: str, contexts: list[int]) -> Step:
    """Decodes with nothing shared."""
    blocks = Blocks(seed=len(contexts))
    tables = [blocks.take(-(-c // BLOCK)) for c in contexts]
    return Step(name, [1] * len(contexts), contexts, tables)


def make_models() -> tuple[LlamaModel, transformers.LlamaForCausalLM]:
    """Ours and Hugging Face's, with the same random weights."""
    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
        vocab_size=CONFIG.vocab_size,
        hidden_size=CONFIG.hidden_size,
        intermediate_size=CONFIG.intermediate_size,
        num_hidden_layers=CONFIG.num_layers,
        num_attention_heads=CONFIG.num_heads,
        num_key_value_heads=CONFIG.num_kv_heads,
        head_dim=CONFIG.head_dim,
        rope_theta=CONFIG.rope_theta,
        rms_norm_eps=CONFIG.rms_norm_eps,
        max_position_embeddings=CONFIG.max_position_embeddings,
        tie_word_embeddings=True,
    )
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    ours = LlamaModel(CONFIG)
    ours.load_weights(hf.state_dict())
    return ours, hf


def run_step(model: LlamaModel, store: KVStore, step: Step, share: bool) -> float:
    """Seconds for build + forward + last-row logits of one step."""
    ids = torch.randint(0, CONFIG.vocab_size, (sum(step.query_lens),))
    start = time.perf_counter()
    md = AttentionMetadata.build(
        step.query_lens, step.context_lens, step.tables, BLOCK, share_prefixes=share
    )
    hidden = model(ids, md.positions, md, store)
    model.compute_logits(hidden[md.last_token_rows])
    return time.perf_counter() - start


def alternate(fns: dict[str, Callable[[], float]], reps: int) -> dict[str, list[float]]:
    """Run each timing function once per round, `reps` rounds after a warm-up round.

    Every other round runs them in reverse order (ABBA), so neither gets a systematic slot.
    """
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    items = list(fns.items())
    for round_ in range(reps):
        for name, fn in items if round_ % 2 == 0 else items[::-1]:
            times[name].append(fn())
    return times


def fmt(times: list[float]) -> str:
    return f"{min(times) * 1e3:8.1f} ms (median {statistics.median(times) * 1e3:7.1f})"


def compare(model: LlamaModel, store: KVStore, step: Step, reps: int) -> list[float]:
    """Print cascade vs no cascade for `step`; return the cascade timings."""
    times = alternate(
        {
            "cascade": lambda: run_step(model, store, step, True),
            "plain": lambda: run_step(model, store, step, False),
        },
        reps,
    )
    md = AttentionMetadata.build(step.query_lens, step.context_lens, step.tables, BLOCK)
    groups = [(len(g.seqs), g.num_tokens) for g in md.shared_prefixes]
    ratio = statistics.median(times["plain"]) / statistics.median(times["cascade"])
    print(f"{step.name}  groups (seqs, shared tokens): {groups or 'none'}")
    print(f"    cascade    {fmt(times['cascade'])}")
    print(f"    no cascade {fmt(times['plain'])}    speedup {ratio:.2f}x (medians)")
    return times["cascade"]


def hf_decode(hf: transformers.LlamaForCausalLM, context: int, reps: int) -> list[float]:
    """Seconds for one decode step of one sequence at `context` tokens, DynamicCache."""
    ids = torch.randint(0, CONFIG.vocab_size, (1, context))
    with torch.inference_mode():
        cache = transformers.DynamicCache(config=hf.config)
        hf(ids[:, :-1], cache=cache, use_cache=True)

        def one() -> float:
            start = time.perf_counter()
            hf(ids[:, -1:], cache=cache, use_cache=True)
            elapsed = time.perf_counter() - start
            cache.crop(-1)  # drop the token again: every repetition decodes at `context`
            return elapsed

        return alternate({"hf": one}, reps)["hf"]


def threshold_sweep(store: KVStore, reps: int) -> None:
    """Attention only, one layer: 16 decodes in groups of n sharing k blocks (+ 40 own tokens).

    Minimum times (the machine is shared); the cost of a group is roughly fixed, the saving
    proportional to the blocks it stops gathering, `(n - 1) * k`.
    """
    print("threshold sweep: one layer's attention for 16 decodes, groups of n sharing k blocks")
    q = torch.randn(16, CONFIG.num_heads, CONFIG.head_dim)
    for n in (2, 4, 16):
        for k in (2, 4, 8, 16, 32, 64):
            fns = {}
            for share in (True, False):
                md = _sweep_metadata(n, k, share)
                fns[str(share)] = lambda md=md: _time_attention(q, store, md)
            times = alternate(fns, reps)
            cascade, plain = (min(times[s]) * 1e6 for s in ("True", "False"))
            print(
                f"    n={n:2d} k={k:2d} saves {(n - 1) * k * BLOCK:5d} tokens/group:"
                f" cascade {cascade:6.0f} us  plain {plain:6.0f} us  speedup {plain / cascade:.2f}x"
            )


def _sweep_metadata(n: int, k: int, share: bool) -> AttentionMetadata:
    """16 decodes in groups of `n` sharing `k` blocks, 40 own tokens each; no thresholds."""
    blocks = Blocks(seed=k)
    tables = []
    for _ in range(16 // n):
        shared = blocks.take(k)
        tables += [shared + blocks.take(3) for _ in range(n)]
    lens = [k * BLOCK + 40] * 16
    return AttentionMetadata.build(
        [1] * 16, lens, tables, BLOCK, share_prefixes=share, min_shared_blocks=1, min_saved_tokens=0
    )


def _time_attention(q: torch.Tensor, store: KVStore, md: AttentionMetadata) -> float:
    """Fastest of 20 calls."""
    best = float("inf")
    for _ in range(20):
        start = time.perf_counter()
        paged_attention(q, store.layers[0], md, CONFIG.head_dim**-0.5)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--steps", default="abc", help="which of the steps a, b, c to run")
    parser.add_argument("--threshold", action="store_true", help="run the threshold sweep only")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.reps} reps")
    store = KVStore.for_model(CONFIG, NUM_BLOCKS, BLOCK, torch.float32)
    for layer in store.layers:
        layer.normal_()
    if args.threshold:
        threshold_sweep(store, args.reps)
        return
    ours, hf = make_models()
    rng = random.Random(1)
    own = [rng.randint(70, 90) for _ in range(64)]
    unrelated = [rng.randint(560, 640) for _ in range(32)]
    steps = [
        shared_step("(a) decode 64 x (1,500 shared + 70-90 own)", 1500, own, None),
        shared_step("(b) prefill 64 x 76 after 1,488 shared", 1488, [76] * 64, 76),
        unrelated_step("(c) decode 32 x ~600 unrelated", unrelated),
    ]
    ours_rate = 0.0
    for step in steps:
        if step.name[1] in args.steps:
            times = compare(ours, store, step, args.reps)
            if step is steps[0]:
                ours_rate = 64 / statistics.median(times)
    theirs = hf_decode(hf, 1580, args.reps)
    print(f"HF LlamaForCausalLM decode, 1 seq of 1,580 tokens: {fmt(theirs)}")
    hf_rate = 1 / statistics.median(theirs)
    if "a" in args.steps:
        print(f"tokens/s: ours (a) {ours_rate:.0f} for 64 seqs vs HF {hf_rate:.1f} for 1 seq")


if __name__ == "__main__":
    main()
