"""How every command stops: SIGTERM as Ctrl-C, exit 0 (130 when a second signal cuts the
graceful part short), a last-resort deadline, and children that cannot outlive us.

Standard library only: every layer (server, router, cluster, Ray) may use it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

log = logging.getLogger(__name__)
CUT_SHORT = 130  # the exit status after a second Ctrl-C/SIGTERM (128 + SIGINT, as shells say)
TEARDOWN_SECONDS = 10.0  # a server's last stage after its graceful part: then it exits anyway


class StopRequest:
    """A signal handler that records the signal as well as raising KeyboardInterrupt: one
    raised inside a callback CPython runs for itself (an import lock's weakref callback, a
    finalizer) is printed as "Exception ignored" and lost, so a loop checks ``requested``."""

    def __init__(self) -> None:
        self.signals: list[int] = []

    def handler(self, signum: int, frame: object) -> None:
        self.signals.append(signum)
        raise KeyboardInterrupt

    @property
    def requested(self) -> bool:
        return bool(self.signals)


_PROCESS_STOP = StopRequest()  # the command's own (installed by ``sigterm_as_ctrl_c``)


def sigterm_as_ctrl_c() -> None:
    """From now on SIGTERM raises ``KeyboardInterrupt`` in the main thread, as Ctrl-C does, so
    both end a command the same way: its cleanup runs and it exits 0 (not killed, -15). Both
    are recorded too, for ``raise_if_stop_requested``. A SIGINT ignored when we started (a
    script's background job inherits it so) is honoured too, as uvicorn and ``cluster`` do:
    ``kill -INT`` stops a server whichever shell started it. A handler of the caller's stays."""
    if threading.current_thread() is not threading.main_thread():  # the main thread's alone
        return
    signal.signal(signal.SIGTERM, _PROCESS_STOP.handler)
    if signal.getsignal(signal.SIGINT) in (signal.default_int_handler, signal.SIG_IGN):
        signal.signal(signal.SIGINT, _PROCESS_STOP.handler)


def raise_if_stop_requested() -> None:
    """``KeyboardInterrupt`` if a stop signal came: a long loop calls this now and then, so a
    signal whose exception CPython dropped (see ``StopRequest``) still ends it."""
    if _PROCESS_STOP.requested:
        raise KeyboardInterrupt


def forget_caught_interrupts() -> None:
    """Clear CPython's "unhandled KeyboardInterrupt" mark before exiting.

    CPython (3.11, 3.12) sets it whenever a KeyboardInterrupt leaves code run by ``exec`` or
    ``eval`` of a string (dataclasses and namedtuple build their methods so, e.g. during an
    import), even when a caller catches it; under ``python -m`` the interpreter then ends by
    killing itself with SIGINT (status -2) whatever the exit code. Every string evaluation
    clears the mark first, so an empty one does."""
    exec("")  # a constant empty string: the reset is the point


HOLD_VARIABLE = "PREFIXCACHE_HOLD_AT"  # the stop tests' hook (tests/test_stop_signals.py)


def hold_point(moment: str) -> None:
    """If ``PREFIXCACHE_HOLD_AT`` names ``moment``, say so on stderr and wait here until a
    signal ends the process: the stop tests signal exactly at that moment, not by luck."""
    if os.environ.get(HOLD_VARIABLE) != moment:
        return
    print(f"prefixcache: holding at {moment}", file=sys.stderr, flush=True)
    while True:
        time.sleep(0.05)


def exit_after(
    seconds: float, code: int, before: Callable[[], None] | None = None
) -> threading.Timer:
    """End this process with ``code`` after ``seconds`` unless it ended already (or the timer
    returned is cancelled): the bound on a shutdown whatever it waits on (``before`` runs
    first, e.g. to kill worker processes)."""

    def expire() -> None:
        log.warning("shutdown still running after %.1f s: exiting now", seconds)
        if before is not None:
            with contextlib.suppress(Exception):
                before()
        logging.shutdown()
        os._exit(code)

    timer = threading.Timer(seconds, expire)
    timer.name, timer.daemon = "shutdown-deadline", True
    timer.start()
    return timer


@contextlib.contextmanager
def sigint_blocked() -> Iterator[None]:
    """SIGINT blocked in this thread: a process started here inherits the mask and so never
    sees a terminal's Ctrl-C (its parent stops it); this thread's other signals are unchanged."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def with_parent_death(command: list[str]) -> list[str]:
    """``command`` killed by the kernel when the thread that starts it dies (SIGKILL too)."""
    setpriv = shutil.which("setpriv")  # util-linux; without it a SIGKILLed parent orphans it
    return [setpriv, "--pdeathsig", "KILL", *command] if setpriv else command


def kill_all(processes: list, timeout: float, hurry: Callable[[], bool] = lambda: False) -> None:
    """SIGTERM to each live ``subprocess.Popen``/``multiprocessing.Process`` at once, then
    SIGKILL to those still running after ``timeout`` seconds (shared, not per process) or
    as soon as ``hurry()`` turns true (e.g. a second Ctrl-C)."""
    live = [p for p in processes if _alive(p)]
    for process in live:
        with contextlib.suppress(OSError):
            process.terminate()
    _wait_all(live, timeout, hurry)
    for process in live:
        if _alive(process):
            with contextlib.suppress(OSError):
                process.kill()
    _wait_all(live, 5.0, lambda: False)  # SIGKILL is not refused: this only reaps them


def kill_descendants(root: int | None = None) -> None:
    """SIGKILL to every process below ``root`` (this one by default; read from /proc): a
    last resort."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with (
                contextlib.suppress(OSError, IndexError, ValueError),
                open(f"/proc/{entry}/stat") as stat,
            ):
                parents[int(entry)] = int(stat.read().rsplit(")", 1)[1].split()[1])
    frontier, below = [os.getpid() if root is None else root], []
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent]
        below += children
        frontier += children
    for pid in below:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL to ``process`` and everything below it (a compiler driver's cc1plus, as, ld:
    killing the driver alone leaves them running), then reap it."""
    kill_descendants(process.pid)
    with contextlib.suppress(OSError):
        process.kill()
    process.wait()


def _alive(process) -> bool:
    poll = getattr(process, "poll", None)
    return poll() is None if poll is not None else process.is_alive()


def _wait_all(processes: list, timeout: float, hurry: Callable[[], bool]) -> None:
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in processes) and time.monotonic() < deadline and not hurry():
        time.sleep(0.05)
