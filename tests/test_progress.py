"""Long work shows progress on a terminal, and nothing anywhere else: the bar itself, the
weight cache's first build in a real pseudo-terminal, and `simulate` piped."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from prefixcache.progress import Ticking, progress_bar

ROOT = Path(__file__).resolve().parents[1]


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_bar_on_a_terminal_and_nothing_on_a_pipe(monkeypatch):
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with progress_bar(3, "packing", "tensor") as advance:
        assert advance is not None
        for _ in range(3):
            advance(1)
    assert "packing" in terminal.getvalue() and "/3 [" in terminal.getvalue()
    pipe = io.StringIO()
    monkeypatch.setattr(sys, "stderr", pipe)
    with progress_bar(3, "packing") as advance:
        assert advance is None
    with progress_bar(0, "nothing") as advance:
        assert advance is None
    assert pipe.getvalue() == ""
    monkeypatch.setattr(sys, "stderr", terminal)
    with progress_bar(3, "quiet", quiet=True) as advance:
        assert advance is None


def test_ticking_counts_each_item_once_as_it_is_first_read():
    ticks: list[int] = []
    items = Ticking({"a": 1, "b": 2, "c": 3}, ticks.append)
    assert items.get("a") == 1 and items["a"] == 1 and items.get("missing") is None
    assert items["b"] == 2 and len(items) == 3 and sorted(items) == ["a", "b", "c"]
    assert ticks == [1, 1]


def run_in_terminal(args: list[str], env: dict[str, str], timeout: float = 120) -> str:
    """Run ``args`` with stdout and stderr on a pseudo-terminal; everything it wrote."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # 0x0 else
    process = subprocess.Popen(args, stdout=follower, stderr=follower, env=env, cwd=ROOT)
    os.close(follower)
    chunks, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 0.5)
        if ready:
            try:
                data = os.read(leader, 65536)
            except OSError:  # the other side closed: the process ended
                break
            if not data:
                break
            chunks.append(data)
        elif process.poll() is not None:
            break
    os.close(leader)
    assert process.wait(timeout=10) == 0, b"".join(chunks).decode(errors="replace")
    return b"".join(chunks).decode(errors="replace")


@pytest.mark.slow
def test_the_weight_caches_first_build_shows_a_bar_on_a_terminal(tmp_path):
    script = (
        "import sys; from pathlib import Path\n"
        "from prefixcache.engine.weight_cache import load_serving_model\n"
        "load_serving_model(None, Path(sys.argv[1]))\n"
    )
    env = dict(os.environ)
    shown = run_in_terminal([sys.executable, "-c", script, str(tmp_path)], env)
    assert "packing SmolLM2-135M-Instruct.Q4_1.gguf" in shown
    assert "tensor" in shown


def test_simulate_shows_its_replay_on_a_terminal_only(tmp_path):
    trace = tmp_path / "trace.jsonl"
    lines = [f'{{"timestamp": {i}, "token_ids": [1, 2, 3, 4, 5, {i}]}}' for i in range(50)]
    trace.write_text("\n".join(lines) + "\n")
    args = [sys.executable, "-m", "prefixcache.cli", "simulate", str(trace), "--capacity", "8"]
    shown = run_in_terminal(args, dict(os.environ))
    assert "replay" in shown and "req" in shown
    piped = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert piped.returncode == 0, piped.stderr
    assert "replay:" not in piped.stderr and "req/s" not in piped.stderr
