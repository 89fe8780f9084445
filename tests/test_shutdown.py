"""prefixcache.shutdown on its own: the exit status after a caught Ctrl-C (issue 38)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CAUGHT_IN_GENERATED_CODE = """
import sys
from prefixcache.shutdown import forget_caught_interrupts

try:  # as when a signal lands in a dataclass's generated __eq__ during an import
    exec("raise KeyboardInterrupt")
except KeyboardInterrupt:
    pass
if sys.argv[1:] == ["forget"]:
    forget_caught_interrupts()
sys.exit(0)
"""


def test_a_caught_interrupt_in_generated_code_exits_0_under_python_m(tmp_path: Path) -> None:
    """CPython 3.11/3.12 would end such a ``python -m`` program killed by SIGINT (-2)."""
    (tmp_path / "caught_then_exits.py").write_text(CAUGHT_IN_GENERATED_CODE)
    command = [sys.executable, "-m", "caught_then_exits", "forget"]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


SIGNAL_DROPPED_THEN_REPLAY = """
import json, os, signal, sys
from prefixcache.shutdown import sigterm_as_ctrl_c
from prefixcache.sim.replay import replay
from prefixcache.sim.traces import load_trace

with open("trace.jsonl", "w") as out:
    for i in range(2000):
        ids = [2 * i, 2 * i + 1]  # two blocks of 512 each, no request sharing one
        line = {"timestamp": i, "input_length": 1024, "output_length": 1, "hash_ids": ids}
        out.write(json.dumps(line) + "\\n")
trace = load_trace("trace.jsonl")
if sys.argv[1:] == ["installed"]:
    sigterm_as_ctrl_c()


class SignalledWhileCollected:
    def __del__(self):  # the handler's KeyboardInterrupt is raised here, printed, dropped
        os.kill(os.getpid(), signal.SIGTERM)


SignalledWhileCollected()
print("the signal was dropped", flush=True)
try:
    replay(trace, capacity=64)
except KeyboardInterrupt:
    sys.exit(3)
sys.exit(0)
"""


def test_a_stop_signal_cpython_drops_still_ends_a_replay(tmp_path: Path) -> None:
    """A signal landing in a finalizer is "Exception ignored": the replay notices it anyway."""
    (tmp_path / "dropped.py").write_text(SIGNAL_DROPPED_THEN_REPLAY)
    command = [sys.executable, "dropped.py", "installed"]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert "Exception ignored" in done.stderr and "the signal was dropped" in done.stdout
    assert done.returncode == 3, done.stderr
