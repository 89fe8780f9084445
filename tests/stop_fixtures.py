"""Stopping a command under test: launch it in a session of its own, signal it (or its
group) at a chosen moment, and say how it ended; shared by the stop-signal test modules."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from process_fixtures import descendants, exit_within, send, survivors


@dataclass(frozen=True)
class Outcome:
    """How one cell ended: exit status ("hang" if not within the deadline), seconds taken,
    processes of ours still running afterwards, and whether a traceback was printed."""

    cell: str
    status: int | str
    seconds: float
    left: tuple[str, ...]
    traceback: bool
    detail: str = ""  # the log from its first traceback on (what a failed run shows)

    @property
    def clean(self) -> bool:
        return self.status == 0 and not self.left and not self.traceback


def cell_name(sig: int, group: bool) -> str:
    return f"{signal.Signals(sig).name} to {'group' if group else 'process'}"


def launch(
    command: list[str], log: Path, env: dict[str, str] | None = None, **options
) -> subprocess.Popen:
    """``command`` in a session of its own (so a group signal reaches it and its children
    only), its output to ``log``, ``env`` added to the environment."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    with log.open("w") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, env=env, **options,
        )  # fmt: skip
    LAUNCHED.append(process)
    return process


def stop(process: subprocess.Popen, log: Path, sig: int, group: bool, deadline: float) -> Outcome:
    """Signal it at this moment; how it ended (its children given a second to go)."""
    family = descendants(process.pid)
    send(process, sig, group)
    return settle(process, log, sig, group, family, deadline)


def settle(
    process: subprocess.Popen, log: Path, sig: int, group: bool, family: dict, deadline: float
) -> Outcome:
    """How ``process``, signalled, ended: ``family`` (its descendants before the signal)
    are given a second to go."""
    status, seconds = exit_within(process, deadline)
    left: list[str] = survivors(family)
    until = time.monotonic() + 1.0
    while left and time.monotonic() < until:
        time.sleep(0.05)
        left = survivors(family)
    text = log.read_text(errors="replace")
    at = text.find("Traceback")
    detail = text[at : at + 3000] if at >= 0 else ""
    return Outcome(cell_name(sig, group), status, round(seconds, 1), tuple(left), at >= 0, detail)


def prefixcache(*arguments: str) -> list[str]:
    return [sys.executable, "-m", "prefixcache.cli", *arguments]


def run_cells(cells: list, function) -> list[Outcome]:
    """``function(*cell)`` for every cell, two at a time (the machine has 2 cores); every
    process a cell started is killed at the end, whatever happened."""
    with ThreadPoolExecutor(2) as pool:
        try:
            return list(pool.map(lambda cell: function(*cell), cells))
        finally:
            kill_launched()


LAUNCHED: list[subprocess.Popen] = []


def kill_launched() -> None:
    """SIGKILL to the group of every process these tests launched that still runs."""
    for process in LAUNCHED:
        if process.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    LAUNCHED.clear()


@pytest.fixture
def nothing_left_running():
    """Use it (``pytest.mark.usefixtures``): each test's processes are killed after it."""
    yield
    kill_launched()


def assert_clean(outcomes: list[Outcome]) -> None:
    assert all(o.clean for o in outcomes), "\n".join(map(str, outcomes))
