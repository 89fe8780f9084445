"""``make compat``: real clients, unchanged, against a real server. One line per client.

Each client gets its own virtual environment under ``.compat/`` (never the project's),
installed from ``compat/clients.txt`` with ``compat/constraints.txt`` (torch pinned to the
local CPU wheel). Then ``prefixcache serve`` starts on a free loopback port with the default
model, every client runs, and the server is stopped with SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENVS = ROOT / ".compat"
MODEL = "SmolLM2-135M-Instruct"
CLIENT_TIMEOUT = 900  # seconds per client run
ENV = {
    "HF_HUB_OFFLINE": "1",  # the tokenizer is a local folder, the data sets local JSONL
    "HF_DATASETS_OFFLINE": "1",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # litellm would fetch a price list
    "TOKENIZERS_PARALLELISM": "false",
    "OPENAI_API_KEY": "unused",
}


def clients() -> dict[str, list[str]]:
    """Client name -> pip arguments, from compat/clients.txt."""
    lines = (ROOT / "compat" / "clients.txt").read_text().splitlines()
    pairs = [line.split() for line in lines if line.strip() and not line.startswith("#")]
    return {name: spec for name, *spec in pairs}


def install(name: str, spec: list[str], python: str) -> str | None:
    """Create and fill .compat/<name> unless it already holds ``spec``; an error or None."""
    env = ENVS / name
    stamp = env / ".installed"
    if stamp.is_file() and stamp.read_text() == " ".join(spec):
        return None
    if not (env / "bin" / "python").exists():
        run([python, "-m", "venv", str(env)])
    pip = [str(env / "bin" / "pip"), "install", "--quiet", "-c", "compat/constraints.txt"]
    result = run([*pip, *spec], timeout=3600)
    if result.returncode != 0:
        return f"install failed: {last_line(result)}"
    stamp.write_text(" ".join(spec))
    return None


def run(command: list[str], timeout: float = CLIENT_TIMEOUT) -> subprocess.CompletedProcess:
    """Run from the repository root with the clients' environment; output captured."""
    env = {**os.environ, **ENV}
    try:
        return subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as error:
        return subprocess.CompletedProcess(command, 124, "", f"timed out after {error.timeout}s")


def last_line(result: subprocess.CompletedProcess) -> str:
    """The most telling line of a failed run: its last error, else its last line."""
    lines = [ln.strip() for ln in (result.stderr + "\n" + result.stdout).splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^\w*(Error|Exception)\b", ln)]
    return (errors or lines or [f"exit code {result.returncode}"])[-1][:300]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(port: int) -> subprocess.Popen:
    """``prefixcache serve`` on loopback; returns once /health answers."""
    log = open(ENVS / "server.log", "w")  # noqa: SIM115 -- the server's lifetime
    server = subprocess.Popen(
        [str(ROOT / ".venv" / "bin" / "prefixcache"), "serve", "--port", str(port),
         "--kv-cache-blocks", "4096", "--served-model-name", MODEL, "--shutdown-timeout", "3"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited; see {ENVS / 'server.log'}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return server
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("the server did not answer /health within 120 s")


def metric(port: int, name: str) -> float:
    """One unlabelled-or-single-series sample from /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    line = next(ln for ln in text.splitlines() if ln.startswith(name))
    return float(line.rsplit(" ", 1)[1])


def check_lm_eval(port: int) -> str:
    """lm-evaluation-harness, ``local-completions``: a multiple-choice and a generate_until task."""
    model_args = (
        f"model={MODEL},base_url=http://127.0.0.1:{port}/v1/completions,"
        f"tokenizer={ENVS / 'tokenizer'},tokenizer_backend=huggingface,tokenized_requests=True,"
        "num_concurrent=2,max_retries=1"
    )
    command = [str(ENVS / "lm-eval" / "bin" / "lm_eval"), "--model", "local-completions",
               "--model_args", model_args, "--batch_size", "4", "--tasks",
               "compat_mc,compat_gen", "--include_path", "compat/tasks"]  # fmt: skip
    result = run(command)
    if result.returncode != 0:
        raise RuntimeError(last_line(result))
    scores = re.findall(r"\|(compat_\w+)?\s*\|.*?\|(\w+)\s*\|↑\s*\|\s*([\d.]+)", result.stdout)
    return ", ".join(f"{metric_name} {float(value):.2f}" for _, metric_name, value in scores)


def check_guidellm(port: int) -> str:
    """guidellm: a synthetic profile whose prompts share a 256-token prefix."""
    before = (
        metric(port, "vllm:prefix_cache_hits_total"),
        metric(port, "vllm:prefix_cache_queries_total"),
    )
    out = ENVS / "guidellm.json"
    command = [str(ENVS / "guidellm" / "bin" / "guidellm"), "run",
               "--backend", f"kind=openai_http,target=http://127.0.0.1:{port},model={MODEL}",
               "--tokenizer", f"kind=hf_auto,model={ENVS / 'tokenizer'}",
               "--profile", "kind=concurrent,streams=4",
               "--constraint", "kind=max_requests,count=16",
               "--data", "kind=synthetic_text,prompt_tokens=64,output_tokens=16,"
               "prefix_tokens=256,prefix_count=1",
               "--output", f"kind=json,path={out}", "--disable-console-interactive"]  # fmt: skip
    result = run(command)
    if result.returncode != 0:
        raise RuntimeError(last_line(result))
    hits = metric(port, "vllm:prefix_cache_hits_total") - before[0]
    queries = metric(port, "vllm:prefix_cache_queries_total") - before[1]
    completed = _guidellm_completed(out)
    return f"{completed} requests, prefix cache hit rate {hits / max(queries, 1):.0%}"


def _guidellm_completed(path: Path) -> str:
    """How many requests guidellm's report counts as successful ('?' if it cannot tell)."""
    try:
        text = path.read_text()
        counts = re.findall(r'"successful"\s*:\s*(\d+)', text) or re.findall(
            r'"completed"\s*:\s*(\d+)', text
        )
        json.loads(text)
        return counts[0] if counts else "?"
    except (OSError, ValueError):
        return "?"


def script_check(name: str, script: str) -> Callable[[int], str]:
    """A check that runs compat/<script> in the client's environment; its last line."""

    def check(port: int) -> str:
        python = str(ENVS / name / "bin" / "python")
        result = run([python, f"compat/{script}", f"http://127.0.0.1:{port}/v1", MODEL])
        if result.returncode != 0:
            raise RuntimeError(last_line(result))
        return result.stdout.strip().splitlines()[-1]

    return check


CHECKS: dict[str, Callable[[int], str]] = {
    "lm-eval": check_lm_eval,
    "guidellm": check_guidellm,
    "langchain": script_check("langchain", "check_langchain.py"),
    "litellm": script_check("litellm", "check_litellm.py"),
    "openai": script_check("openai", "check_openai.py"),
    "agents": script_check("agents", "check_agents.py"),
    "instructor": script_check("instructor", "check_instructor.py"),
    "langchain-tools": script_check("langchain-tools", "check_langchain_tools.py"),
    "litellm-tools": script_check("litellm-tools", "check_litellm_tools.py"),
}


def stop_server(server: subprocess.Popen) -> str:
    """SIGTERM; how long the server took to exit."""
    started = time.monotonic()
    server.send_signal(signal.SIGTERM)
    try:
        code = server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        return "error: still running 30 s after SIGTERM (killed)"
    took = time.monotonic() - started
    clean = "Application shutdown complete" in (ENVS / "server.log").read_text()
    if code in (0, -signal.SIGTERM) and clean:  # uvicorn re-raises the signal once done
        return f"ok (drained and exited {took:.1f} s after SIGTERM)"
    return f"error: exit code {code} {took:.1f} s after SIGTERM; see {ENVS / 'server.log'}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--python", default="python3", help="interpreter for the client venvs")
    parser.add_argument("clients", nargs="*", help="run only these (default: all)")
    args = parser.parse_args()
    ENVS.mkdir(exist_ok=True)
    wanted = {n: s for n, s in clients().items() if not args.clients or n in args.clients}
    problems = {name: install(name, spec, args.python) for name, spec in wanted.items()}
    exported = run([str(ROOT / ".venv" / "bin" / "prefixcache"), "export-tokenizer",
                    str(ENVS / "tokenizer")])  # fmt: skip
    if exported.returncode != 0:
        print(f"export-tokenizer: error: {last_line(exported)}")
        return 1
    port = free_port()
    server = start_server(port)
    failed = 0
    try:
        for name in wanted:
            if problems[name]:
                outcome = f"error: {problems[name]}"
            else:
                try:
                    outcome = f"ok ({CHECKS[name](port)})"
                except Exception as error:  # one line per client, whatever went wrong
                    outcome = f"error: {error}"
            failed += outcome.startswith("error")
            print(f"{name}: {outcome}", flush=True)
    finally:
        line = stop_server(server)
        print(f"server shutdown: {line}", flush=True)
    return 1 if failed or line.startswith("error") else 0


if __name__ == "__main__":
    sys.exit(main())
