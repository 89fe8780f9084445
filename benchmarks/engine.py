"""The engine on the default model: caching on vs off vs transformers, in one run.

Workloads (issue 3): a shared system prompt (requests sent at once), multi-turn chat
(each turn resends the history), and no reuse (unrelated prompts). Each runs with
prefix caching on and off; the first also through transformers' ``generate`` on the
same weights, one request at a time. Then two micro-measurements: prefill of a
2,000-token prompt per token, and decode of 32 sequences at once vs one at a time.
Throughput counts prompt + generated tokens per second of wall time.

Then issue 12's cases (also the ones `benchmarks/peers.py` runs beside llama.cpp): a
540-token document followed by 16 different questions, 8 tokens out, greedy: the 16
requests one at a time (total, and TTFT p50 of the 15 that find the document cached), all
16 at once, and the decode speed of a single sequence. `--document` runs only those;
`--kernels` times the int4 kernel against the dense matmul per batch size instead.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from prefixcache import LLM, SamplingParams
from prefixcache.engine.weights import load_model

WORDS = [
    "cache", "block", "prefix", "token", "model", "request", "memory", "policy", "tenant",
    "reuse", "latency", "attention", "kernel", "scheduler", "eviction", "table", "hash",
    "chain", "salt", "namespace", "decode",
]  # fmt: skip


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def document_prompts(tokenizer, questions: int = 16, doc_tokens: int = 540) -> list[list[int]]:
    """A `doc_tokens`-token document (BOS first), then one different question per prompt."""
    rng = random.Random(12)
    document = tokenizer.encode(text(rng, doc_tokens), add_special_tokens=True)[:doc_tokens]
    asks = [
        f"\n\nQuestion {i + 1}: how often does the word '{rng.choice(WORDS)}' come right "
        f"after '{rng.choice(WORDS)}' above?\nAnswer:"
        for i in range(questions)
    ]
    return [document + tokenizer.encode(ask) for ask in asks]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def run_one_at_a_time(llm: LLM, prompts: list[list[int]], max_tokens: int = 8) -> dict:
    """Each prompt after the previous one finished: total seconds, cached-request TTFT p50."""
    start = time.perf_counter()
    outputs = [llm.generate([p], greedy(max_tokens))[0] for p in prompts]
    cached = [o.metrics.ttft for o in outputs[1:]]
    return {"seconds": time.perf_counter() - start, "ttft_p50": statistics.median(cached)}


def run_at_once(llm: LLM, prompts: list[list[int]], max_tokens: int = 8) -> dict:
    """All prompts submitted together: total seconds."""
    start = time.perf_counter()
    llm.generate(prompts, greedy(max_tokens))
    return {"seconds": time.perf_counter() - start}


def run_decode(llm: LLM, prompt: list[int], tokens: int = 64) -> dict:
    """One sequence: tokens per second after its first token."""
    start = time.perf_counter()
    (output,) = llm.generate([prompt], greedy(tokens + 1))
    elapsed = time.perf_counter() - start
    return {"tokens_per_s": tokens / (elapsed - output.metrics.ttft)}


def document_cases(llm: LLM, prompts: list[list[int]]) -> dict:
    """Issue 12's cases on one engine, each starting from an empty cache."""
    results = {}
    for name, run in (("one at a time", run_one_at_a_time), ("16 at once", run_at_once)):
        llm.engine.manager.reset()
        results[name] = run(llm, prompts)
    llm.engine.manager.reset()
    results["decode"] = run_decode(llm, prompts[0])
    return results


def document_lines(results: dict) -> list[str]:
    one, many, decode = results["one at a time"], results["16 at once"], results["decode"]
    return [
        "document + 16 questions, 8 tokens out, greedy:",
        f"  one at a time {one['seconds']:6.2f}s   cached TTFT p50 {one['ttft_p50']:6.3f}s",
        f"  16 at once    {many['seconds']:6.2f}s",
        f"  single-sequence decode {decode['tokens_per_s']:6.1f} tok/s",
    ]


def weight_bytes_per_token(model) -> int:
    """Weight bytes one decode step reads: each projection and the output matrix."""
    from prefixcache.engine.int4_head import Int4Head
    from prefixcache.engine.quant import Int4Linear

    def nbytes(linear) -> int:
        if isinstance(linear, Int4Linear):
            return linear.nbytes_read
        if isinstance(linear, Int4Head):
            return linear.planes.nbytes_read
        return linear.weight.numel() * linear.weight.element_size()

    layers = [(layer.qkv, layer.o, layer.gate_up, layer.down) for layer in model.layers]
    return sum(nbytes(linear) for group in layers for linear in group) + nbytes(model.head)


def kernel_lines(max_rows: int = 64) -> list[str]:
    """The int4 kernel vs the dense fp32 matmul on W', per batch size, over 30 layers."""
    from prefixcache.engine import quant

    loaded = load_model()
    linears = [quant.Int4Linear(b) for n, b in loaded.quantized.items() if ".mlp.gate_proj" in n]
    lines = ["int4 kernel vs dense matmul (gate_proj of every layer, ms per pass):"]
    for rows in (1, 2, 4, 8, 12, 16, 24, 32, 48, max_rows):
        x = torch.randn(rows, linears[0].weight.shape[1]).bfloat16()
        timings = []
        for run in (quant.int4_matmul, quant.dense_matmul):
            start = time.perf_counter()
            for _ in range(5):
                for linear in linears:
                    run(linear, x)
            timings.append((time.perf_counter() - start) / 5 * 1e3)
        lines.append(f"  rows {rows:3}: int4 {timings[0]:7.2f}   dense {timings[1]:7.2f}")
    return lines


def shared_prompt_workload(rng: random.Random, requests: int) -> list[list[dict]]:
    system = text(rng, 1300)  # about 1,500 tokens with the template
    return [
        [{"role": "system", "content": system}, {"role": "user", "content": text(rng, 55)}]
        for _ in range(requests)
    ]


def no_reuse_workload(rng: random.Random, requests: int) -> list[list[dict]]:
    return [[{"role": "user", "content": text(rng, 440)}] for _ in range(requests)]


def run_engine(llm: LLM, conversations, max_tokens: int) -> dict:
    """All conversations at once; throughput, TTFT percentiles, cached share."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.chat(conversations, params)
    return summarize(outputs, time.perf_counter() - start)


def run_multi_turn(llm: LLM, rng: random.Random, conversations: int, turns: int) -> dict:
    """Each turn of every conversation at once; the next turn resends the history."""
    histories = [[{"role": "system", "content": text(rng, 120)}] for _ in range(conversations)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outputs, elapsed = [], 0.0
    for _ in range(turns):
        for history in histories:
            history.append({"role": "user", "content": text(rng, 40)})
        start = time.perf_counter()
        turn = llm.chat(histories, params)
        elapsed += time.perf_counter() - start
        outputs += turn
        for history, output in zip(histories, turn, strict=True):
            history.append({"role": "assistant", "content": output.text})
    return summarize(outputs, elapsed)


def summarize(outputs, elapsed: float) -> dict:
    tokens = sum(len(o.prompt_token_ids) + len(o.token_ids) for o in outputs)
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    ttfts = sorted(o.metrics.ttft for o in outputs)
    return {
        "throughput": tokens / elapsed,
        "ttft_p50": statistics.median(ttfts),
        "ttft_p95": ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))],
        "cached_share": sum(o.num_cached_tokens for o in outputs) / prompt,
        "seconds": elapsed,
    }


def run_transformers(model, tokenizer, conversations, max_tokens: int) -> dict:
    """The same requests through transformers' generate, one at a time."""
    tokens, ttfts, elapsed = 0, [], 0.0
    for conversation in conversations:
        ids = torch.tensor([tokenizer.encode_chat(conversation)])
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=1, do_sample=False)
            ttfts.append(time.perf_counter() - start)
            out = model.generate(
                ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False
            )
        elapsed += time.perf_counter() - start - ttfts[-1]  # TTFT probe not counted twice
        tokens += out.shape[1]
    ttfts.sort()
    return {
        "throughput": tokens / elapsed,
        "ttft_p50": statistics.median(ttfts),
        "ttft_p95": ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))],
        "cached_share": 0.0,
        "seconds": elapsed,
    }


def line(name: str, result: dict) -> str:
    return (
        f"  {name:<24} {result['throughput']:9.1f} tok/s   TTFT p50 {result['ttft_p50']:7.3f}s"
        f"  p95 {result['ttft_p95']:7.3f}s   cached {result['cached_share']:6.1%}"
        f"   ({result['seconds']:.1f}s)"
    )


def micro(llm: LLM, reference) -> list[str]:
    """Prefill of 2,000 tokens per token, and decode of 32 sequences vs one at a time."""
    rng = random.Random(7)
    prompt = [rng.randrange(1000, 40000) for _ in range(2000)]
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    ours = time.perf_counter() - start
    with torch.inference_mode():
        start = time.perf_counter()
        reference(torch.tensor([prompt]))
        theirs = time.perf_counter() - start
    batches = [
        [[rng.randrange(1000, 40000) for _ in range(64)] for _ in range(32)] for _ in range(2)
    ]
    timings = []
    for batch, max_tokens in zip(batches, (1, 65), strict=True):  # prefill only, then +64
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(batch, params)
        timings.append(time.perf_counter() - start)
    decode_ours = 32 * 64 / (timings[1] - timings[0])
    with torch.inference_mode():
        start = time.perf_counter()
        reference.generate(
            torch.tensor([batches[1][0]]), max_new_tokens=64, min_new_tokens=64, do_sample=False
        )
        decode_theirs = 64 / (time.perf_counter() - start)
    return [
        f"  prefill 2,000 tokens: ours {ours:.2f}s, transformers {theirs:.2f}s "
        f"-> ratio ours/transformers {ours / theirs:.2f} (goal <= 1.0)",
        f"  decode: 32 at once {decode_ours:.1f} tok/s, transformers one at a time "
        f"{decode_theirs:.1f} tok/s -> {decode_ours / decode_theirs:.1f}x (goal >= 10x)",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument(
        "--reference-requests",
        type=int,
        default=8,
        help="transformers runs one at a time: its throughput is measured "
        "on this many of the shared-prompt requests",
    )
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--document", action="store_true", help="only issue 12's cases")
    parser.add_argument("--kernels", action="store_true", help="only the int4/dense sweep")
    parser.add_argument(
        "--dequantize",
        action="store_true",
        help="the exact fp32 path (serve --dequantize): the kernels before issue 12, to compare",
    )
    args = parser.parse_args()
    weights = {"quantized_weights": not args.dequantize}
    torch.set_num_threads(torch.get_num_threads())
    if args.kernels:
        for name in ("int4", "dequantized"):
            llm = LLM(num_kv_blocks=16, quantized_weights=name == "int4")
            mb = weight_bytes_per_token(llm.engine.model) / 1e6
            print(f"weight bytes per decoded token, {name}: {mb:.1f} MB")
        print("\n".join(kernel_lines()))
        return
    if args.document:
        llm = LLM(**weights)
        print("\n".join(document_lines(document_cases(llm, document_prompts(llm.tokenizer)))))
        return
    results = {}
    engines = {
        "cache on": LLM(enable_prefix_caching=True, **weights),
        "cache off": LLM(enable_prefix_caching=False, **weights),
    }
    workloads = {  # each workload runs on then off back to back, so load drift hits both
        "shared": lambda llm: run_engine(
            llm, shared_prompt_workload(random.Random(1), args.requests), 32
        ),
        "multi-turn": lambda llm: run_multi_turn(llm, random.Random(2), args.conversations, 4),
        "no reuse": lambda llm: run_engine(
            llm, no_reuse_workload(random.Random(3), args.requests), 32
        ),
    }
    for workload, run in workloads.items():
        for tag, llm in engines.items():
            llm.engine.manager.reset()
            results[(workload, tag)] = run(llm)
    from transformers import AutoModelForCausalLM

    loaded = load_model()
    reference = AutoModelForCausalLM.from_pretrained(
        str(loaded.source.parent), gguf_file=loaded.source.name, dtype=torch.float32
    )
    shared = shared_prompt_workload(random.Random(1), args.requests)[: args.reference_requests]
    results[("shared", "transformers")] = run_transformers(reference, loaded.tokenizer, shared, 32)
    kind = "dequantized fp32" if args.dequantize else "int4"
    print(f"engine benchmark, default model ({kind} weights), {torch.get_num_threads()} threads")
    for workload in ("shared", "multi-turn", "no reuse"):
        print(f"{workload}:")
        for tag in ("cache on", "cache off", "transformers"):
            if (workload, tag) in results:
                print(line(tag, results[(workload, tag)]))
    on, off = results[("shared", "cache on")], results[("shared", "cache off")]
    hf = results[("shared", "transformers")]
    print(
        f"  shared prompt: cache on / off {on['throughput'] / off['throughput']:.1f}x "
        f"(goal >= 5x); cache on / transformers {on['throughput'] / hf['throughput']:.1f}x "
        f"(goal >= 20x)"
    )
    mt_on, mt_off = results[("multi-turn", "cache on")], results[("multi-turn", "cache off")]
    print(f"  multi-turn: cache on / off {mt_on['throughput'] / mt_off['throughput']:.1f}x")
    nr_on, nr_off = results[("no reuse", "cache on")], results[("no reuse", "cache off")]
    slower = 1 - nr_on["throughput"] / nr_off["throughput"]
    print(f"  no reuse: cache on is {slower:+.1%} slower than off (goal <= 3%)")
    print("\n".join(micro(engines["cache off"], reference)))
    prompts = document_prompts(loaded.tokenizer)
    print("\n".join(document_lines(document_cases(engines["cache on"], prompts))))


if __name__ == "__main__":
    main()
