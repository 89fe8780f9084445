"""Helpers for tests that run a real command (`prefixcache cluster`, `prefixcache ray`), and
the process table they check (read from /proc)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
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


def _entry(pid: int | str) -> tuple[int, str] | None:
    """``pid``'s (parent pid, command line) from /proc; None once it exited or is a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            command = cmdline.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:  # it exited meanwhile
        return None
    return None if fields[0] == "Z" else (int(fields[1]), command)


def process_table() -> dict[int, tuple[int, str]]:
    """Every live process: pid -> (parent pid, command line), read from /proc (no zombies)."""
    entries = {int(pid): _entry(pid) for pid in os.listdir("/proc") if pid.isdigit()}
    return {pid: entry for pid, entry in entries.items() if entry is not None}


def descendants(pid: int) -> dict[int, str]:
    """The live processes below ``pid`` (children, theirs, ...): pid -> command line."""
    table, found, frontier = process_table(), {}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, (ppid, command) in table.items():
            if ppid == parent and child not in found:
                found[child] = command
                frontier.append(child)
    return found


def survivors(processes: dict[int, str]) -> list[str]:
    """Those of ``processes`` (pid -> command line) still running as the same command (their
    own /proc entries only: the loops that poll this would read every process's otherwise).
    An empty command line names nothing (a process caught mid-exit reads ""; its pid may then
    go to a kernel thread, which reads "" too, and was once counted as left running)."""
    return [
        command
        for pid, command in processes.items()
        if command and (_entry(pid) or (0, ""))[1] == command
    ]


def send(process: subprocess.Popen, sig: int, to_group: bool) -> None:
    """``sig`` to the process, or to its whole process group (a terminal's Ctrl-C; it must
    have been started with ``start_new_session``)."""
    if to_group:
        os.killpg(process.pid, sig)
    else:
        process.send_signal(sig)


def exit_within(process: subprocess.Popen, timeout: float) -> tuple[int | str, float]:
    """(exit status, seconds taken) or ("hang", timeout) after killing its group."""
    started = time.monotonic()
    try:
        return process.wait(timeout), time.monotonic() - started
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(process.pid, signal.SIGKILL)
        process.kill()
        process.wait()
        return "hang", timeout


def serve_usage_error(*flags: str) -> str:
    """`prefixcache serve` with ``flags`` exits 2 without a traceback: its last stderr line."""
    done = subprocess.run(
        [sys.executable, "-m", "prefixcache.cli", "serve", *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    return done.stderr.strip().splitlines()[-1]
