"""What the benchmarks that start real servers share: a free loopback port, a health wait,
and a Ctrl-C that ends one."""

from __future__ import annotations

import signal
import socket
import subprocess
import time

import httpx


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, timeout: float = 180.0) -> None:
    """Return once ``url``/health answers 200; RuntimeError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not become healthy in {timeout:g} s")


def interrupt(process: subprocess.Popen, timeout: float = 30.0) -> None:
    """Ctrl-C (a clean shutdown), then SIGKILL after ``timeout`` seconds."""
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
