"""Child processes the tests start (a router, Prometheus, a replica): waiting until one
answers, and stopping one."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable

import httpx

import loopback


def wait_answering(
    process: subprocess.Popen, url: str, name: str, log_tail: Callable[[], str], timeout: float
) -> None:
    """Until ``url`` answers 200; RuntimeError with the log's tail if ``process`` exits or
    ``timeout`` seconds pass first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited: {log_tail()}")
        try:
            if loopback.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{name} did not start: {log_tail()}")


def terminate(process: subprocess.Popen | None) -> None:
    """SIGTERM, then SIGKILL if it has not exited within 10 s."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)
