"""One child process of a Ray actor, tied to the actor's life, and files only it may read.

The child is started from a thread that lives as long as the actor, under ``setpriv
--pdeathsig KILL``, so the kernel kills it when the actor dies, by SIGKILL included.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from prefixcache.protocol import loopback_http
from prefixcache.shutdown import with_parent_death

START_TIMEOUT_S = 180.0  # a cold model build on a loaded node
POLL_S = 0.2
STOP_TIMEOUT_S = 10.0


def prefixcache_command(*arguments: str) -> list[str]:
    """``prefixcache ARGUMENTS`` with this interpreter, dying with its parent where it can."""
    return with_parent_death([sys.executable, "-m", "prefixcache.cli", *arguments])


class PrivateFolder:
    """A temporary folder of mode 0700 for secrets handed over through Ray."""

    def __init__(self, prefix: str) -> None:
        self.path = Path(tempfile.mkdtemp(prefix=prefix))

    def write(self, name: str, data: bytes) -> Path:
        """``name`` in the folder, mode 0600, holding ``data``."""
        path = self.path / name
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "wb") as file:
            file.write(data)
        return path

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


class ChildKeeper:
    """Starts ``command``, waits until ``ready_url`` answers, then calls ``tick`` every
    ``period_s`` until stopped; all from one thread that lives as long as the actor."""

    def __init__(
        self,
        command: list[str],
        env: dict[str, str],
        ready_url: str,
        tick: Callable[[], None],
        period_s: float,
    ) -> None:
        self.command, self.env, self.ready_url = command, env, ready_url
        self.tick, self.period_s = tick, period_s
        self.process: subprocess.Popen | None = None
        self.ready = threading.Event()
        self.stopping = threading.Event()
        self.failure: str | None = None
        self.thread = threading.Thread(target=self._keep, name="prefixcache-keeper", daemon=True)
        self.thread.start()

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Block until the child answers; RuntimeError saying why if it exits or is late."""
        deadline = time.monotonic() + timeout_s
        while not self.ready.wait(POLL_S):
            if self.failure is not None:
                raise RuntimeError(self.failure)
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.command[-1]} did not answer within {timeout_s:.0f} s")

    def exit_code(self) -> int | None:
        """The child's exit status; None while it runs."""
        return None if self.process is None else self.process.poll()

    def stop(self) -> None:
        """SIGTERM (a clean shutdown), then SIGKILL after ``STOP_TIMEOUT_S``."""
        self.stopping.set()
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def _keep(self) -> None:
        self.process = subprocess.Popen(self.command, env={**os.environ, **self.env})
        while not self.stopping.is_set() and not self._answers():
            if self.process.poll() is not None:
                self.failure = f"the child exited with {self.process.returncode} before answering"
                return
            time.sleep(POLL_S)
        self.ready.set()
        self.tick()
        while not self.stopping.wait(self.period_s):
            if self.process.poll() is not None:
                return  # check_health reports it; Ray replaces the actor
            self.tick()

    def _answers(self) -> bool:
        try:
            loopback_http.get(self.ready_url, timeout=1.0)
            return True
        except httpx.HTTPError:
            return False


class Supervisor:
    """A Serve replica that owns one child and one secrets folder; Serve's graceful stop
    calls ``__del__``: the child gets SIGTERM (then SIGKILL), the folder is deleted."""

    keeper: ChildKeeper | None = None
    folder: PrivateFolder | None = None

    def __del__(self) -> None:
        if self.keeper is not None:
            self.keeper.stop()
        if self.folder is not None:
            self.folder.remove()
