"""Helpers for tests that run a real command (`prefixcache cluster`, `prefixcache ray`)."""

from __future__ import annotations

import subprocess
import threading
import time


def wait_for(predicate, what: str, timeout: float = 120.0) -> None:
    """Poll ``predicate`` every half second; AssertionError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


def read_lines(process: subprocess.Popen) -> list[str]:
    """The process's output lines, appended as they come (from a daemon thread)."""
    lines: list[str] = []

    def read() -> None:
        for line in process.stdout:
            lines.append(line)

    threading.Thread(target=read, daemon=True).start()
    return lines
