"""The live screen: a rich ``Live`` redrawn every interval, keys read from stdin in cbreak
mode on a thread (``q`` quits at once), the terminal restored however the view ends."""

from __future__ import annotations

import contextlib
import os
import select
import sys
import termios
import threading
import tty
from collections.abc import Callable, Iterator

from rich.console import Console, RenderableType
from rich.live import Live

QUIT_KEYS = frozenset("qQ")
KEY_POLL_S = 0.05


class KeyReader:
    """Reads single keys from a terminal's stdin until ``q`` (then sets ``quit``)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.quit = threading.Event()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="top-keys", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=1.0)

    def _run(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self.fd], [], [], KEY_POLL_S)
            if not ready:
                continue
            data = os.read(self.fd, 64)
            if not data or QUIT_KEYS & set(data.decode(errors="ignore")):
                self.quit.set()  # q, or stdin closed: nobody can press q any more
                return


@contextlib.contextmanager
def cbreak(fd: int) -> Iterator[None]:
    """Keys arrive one at a time, unechoed; Ctrl-C still interrupts. Restored on exit."""
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd, termios.TCSANOW)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def run_live(frame: Callable[[], RenderableType], interval: float, console: Console) -> None:
    """Redraw ``frame()`` every ``interval`` s on the alternate screen until ``q`` or Ctrl-C."""
    fd = sys.stdin.fileno()
    with cbreak(fd), Live(console=console, screen=True, auto_refresh=False) as live:
        keys = KeyReader(fd)
        keys.start()
        try:
            while not keys.quit.is_set():
                live.update(frame(), refresh=True)
                keys.quit.wait(interval)
        finally:
            keys.stop()
