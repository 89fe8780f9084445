"""Side by side with llama.cpp (llama-cpp-python) on the same GGUF, prompts and threads.

Issue 12's cases, measured in one run: a 540-token document followed by 16 different
questions, 8 tokens out, greedy (EOS ignored on both sides), the same token ids fed to both:
  - one at a time: each request after the previous finished (llama.cpp reuses the longest
    prefix of its previous prompt, as llama-server's prompt cache does; we use the prefix
    cache), total seconds and TTFT p50 of the 15 requests whose document is cached;
  - 16 at once: ours submits all 16 together; llama-cpp-python has no parallel slots, so it
    serves them one after another without reuse across them (llama-server's slots do not
    share a prefix either, but would batch the decode steps);
  - single-sequence decode tokens/s (64 tokens after the first).
The llama.cpp side runs in its own venv (`make bench-peers` builds `.venv-peers`); without
it this prints our side and says how to get the other.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

PEER_PYTHON = Path(__file__).resolve().parent.parent / ".venv-peers" / "bin" / "python"


# ---------------------------------------------------------------- llama.cpp side (peer venv)


def peer_main() -> None:
    """Read a job (model, threads, prompts) as JSON on stdin; print the timings as JSON."""
    import llama_cpp.llama_cpp as llama_cpp  # the bindings `Llama` reads its defaults from
    from llama_cpp import Llama

    # ggml's AMX matmul (an "extra buffer type") segfaults on this GGUF on this machine's
    # CPU; without extra buffer types llama.cpp runs its plain AVX-512 Q4_1/Q8_0 kernels.
    default_params = llama_cpp.llama_model_default_params

    def model_params() -> llama_cpp.llama_model_params:
        params = default_params()
        params.use_extra_bufts = False
        return params

    llama_cpp.llama_model_default_params = model_params
    job = json.load(sys.stdin)
    threads = job["threads"]
    llm = Llama(
        model_path=job["model"],
        n_ctx=job["n_ctx"],
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    prompts, max_tokens = job["prompts"], job["max_tokens"]
    complete(llm, prompts[0], 2, reuse=False)  # warm-up
    json.dump(peer_cases(llm, prompts, max_tokens), sys.stdout)


def complete(llm, prompt: list[int], max_tokens: int, reuse: bool) -> tuple[float, float]:
    """Greedy tokens for `prompt` (EOS ignored): (TTFT, total seconds)."""
    if not reuse:
        llm.reset()
    start = time.perf_counter()
    first = None
    for count, _ in enumerate(llm.generate(prompt, temp=0.0, top_k=1, reset=True), 1):
        if first is None:
            first = time.perf_counter() - start
        if count == max_tokens:
            break
    return first, time.perf_counter() - start


def peer_cases(llm, prompts: list[list[int]], max_tokens: int) -> dict:
    """The same cases as `document_cases` in benchmarks/engine.py."""
    llm.reset()
    start = time.perf_counter()
    ttfts = [complete(llm, p, max_tokens, reuse=True)[0] for p in prompts]
    one = {"seconds": time.perf_counter() - start, "ttft_p50": _median(ttfts[1:])}
    start = time.perf_counter()
    for prompt in prompts:
        complete(llm, prompt, max_tokens, reuse=False)
    many = {"seconds": time.perf_counter() - start}
    ttft, total = complete(llm, prompts[0], 65, reuse=False)
    decode = {"tokens_per_s": 64 / (total - ttft)}
    return {"one at a time": one, "16 at once": many, "decode": decode}


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


# ---------------------------------------------------------------- our side (project venv)


def run_peer(python: Path, job: dict) -> dict:
    """The llama.cpp side in its own interpreter."""
    proc = subprocess.run(
        [str(python), __file__, "--peer"],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode:
        raise RuntimeError(f"the llama.cpp side failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def ratio_lines(ours: dict, theirs: dict) -> list[str]:
    """Each case with llama.cpp's number and our speed relative to it (> 1: we are faster)."""
    rows = [
        ("one at a time, total", "one at a time", "seconds", "s", False),
        ("cached-request TTFT p50", "one at a time", "ttft_p50", "s", False),
        ("16 at once, total", "16 at once", "seconds", "s", False),
        ("single-sequence decode", "decode", "tokens_per_s", " tok/s", True),
    ]
    lines = [f"  {'case':<26} {'prefixcache':>14} {'llama.cpp':>14}   speed ratio"]
    for label, case, key, unit, higher_is_better in rows:
        a, b = ours[case][key], theirs[case][key]
        speed = a / b if higher_is_better else b / a
        lines.append(f"  {label:<26} {a:>9.3f}{unit:<5} {b:>9.3f}{unit:<5}   {speed:5.2f}x")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--peer-python", type=Path, default=PEER_PYTHON)
    parser.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, help="both sides (default: torch's choice)")
    args = parser.parse_args()
    if args.peer:
        peer_main()
        return
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    from engine import document_cases, document_lines, document_prompts
    from prefixcache import LLM
    from prefixcache.engine.model_files import default_model_path

    threads = torch.get_num_threads()
    llm = LLM()
    prompts = document_prompts(llm.tokenizer)
    document_cases(llm, prompts[:2])  # warm-up
    ours = document_cases(llm, prompts)
    print(f"prefixcache vs llama.cpp, default model, {threads} threads, one run")
    print("\n".join(document_lines(ours)))
    if not args.peer_python.exists():
        print(f"llama.cpp side skipped: {args.peer_python} not found (run `make bench-peers`)")
        return
    del llm
    job = {"model": str(default_model_path()), "threads": threads, "n_ctx": 4096}
    theirs = run_peer(args.peer_python, {**job, "prompts": prompts, "max_tokens": 8})
    print("\n".join(ratio_lines(ours, theirs)))


if __name__ == "__main__":
    main()
