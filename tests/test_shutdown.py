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
