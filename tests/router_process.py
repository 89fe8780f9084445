"""A real ``prefixcache route`` process on loopback: its log (stderr) and memory can be read."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from child_process import wait_answering
from server_fixtures import free_port

START_TIMEOUT_S = 60.0


@dataclass
class RouterProcess:
    """``python -m prefixcache.cli route`` over ``replicas``, logging to a file of its own."""

    replicas: list[str]
    workdir: Path
    extra_args: tuple[str, ...] = ()
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"router-{self.port}.log"

    def command(self) -> list[str]:
        replicas = [arg for url in self.replicas for arg in ("--replica", url)]
        return [
            sys.executable, "-m", "prefixcache.cli", "route", *replicas,
            "--port", str(self.port), "--health-interval", "0.5", *self.extra_args,
        ]  # fmt: skip

    def start(self) -> RouterProcess:
        """Launch and wait until its ``/health`` says a replica is up."""
        with self.log_path.open("a") as log:
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            self.process = subprocess.Popen(
                self.command(), stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=env
            )
        health = f"{self.url}/health"
        wait_answering(self.process, health, "router", self.log_tail, START_TIMEOUT_S)
        return self

    def log_tail(self) -> str:
        return self.log_text()[-3000:]

    def rss_bytes(self) -> int:
        """Its resident memory now (Linux ``VmRSS``)."""
        assert self.process is not None
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        line = next(line for line in status.splitlines() if line.startswith("VmRSS:"))
        return int(line.split()[1]) * 1024

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
