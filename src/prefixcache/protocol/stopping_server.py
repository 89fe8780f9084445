"""uvicorn that counts stop signals: one starts a bounded graceful shutdown, two end it now.

Shared by ``prefixcache serve`` and ``prefixcache route``: the first SIGINT/SIGTERM stops
accepting and lets running requests finish for the config's ``timeout_graceful_shutdown``;
with ``hard_deadline`` the process exits ``TEARDOWN_SECONDS`` later whatever still runs
(status 1: something hung), and a second signal ends it at once with status 130 (without:
uvicorn's forced exit, for servers run inside another program).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable
from types import FrameType

import uvicorn

from prefixcache.shutdown import CUT_SHORT, TEARDOWN_SECONDS, exit_after

log = logging.getLogger(__name__)
CUT_SHORT_SECONDS = 2.0  # after a second signal: the last words, then exit 130


class StoppingServer(uvicorn.Server):
    """See the module; subclasses add ``on_first_signal`` and ``last_words`` (run before a
    forced exit, e.g. to kill worker processes)."""

    def __init__(self, config: uvicorn.Config, hard_deadline: bool = False) -> None:
        super().__init__(config)
        self.hard_deadline, self.signals = hard_deadline, 0

    @property
    def cut_short(self) -> bool:
        """A second signal ended the graceful part early (exit status 130)."""
        return self.signals > 1

    @property
    def shutdown_timeout(self) -> float:
        return self.config.timeout_graceful_shutdown or 0.0

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.signals += 1
        if self.signals == 1:
            self.on_first_signal()
            if self.hard_deadline:
                exit_after(self.shutdown_timeout + TEARDOWN_SECONDS, 1, self.last_words)
        elif self.signals == 2 and self.hard_deadline:
            self._exit_now()
        elif self.signals == 2:
            self.force_exit = True  # uvicorn does it for a second SIGINT only
        super().handle_exit(sig, frame)

    def _exit_now(self) -> None:
        """Exit 130 from the handler: the requests still running are dropped with their
        connections (uvicorn's forced exit would cancel them and log each traceback)."""
        log.warning("second signal: exiting now")
        exit_after(CUT_SHORT_SECONDS, CUT_SHORT)  # should the last words hang
        with contextlib.suppress(Exception):
            self.last_words()
        logging.shutdown()
        sys.stdout.flush()
        os._exit(CUT_SHORT)

    def on_first_signal(self) -> None:
        """Called once, from the signal handler, before uvicorn starts stopping."""

    def before_the_deadline(self, end_the_rest: Callable[[], None]) -> None:
        """Call ``end_the_rest`` (from a timer thread) a little before uvicorn would cancel the
        requests still running: then they can still end with an error event or a 503."""
        timeout = self.shutdown_timeout
        delay = max(0.0, timeout - min(1.0, timeout / 2))
        timer = threading.Timer(delay, end_the_rest)
        timer.name, timer.daemon = "drain-deadline", True
        timer.start()

    def last_words(self) -> None:
        """Called from the deadline's thread just before the process exits."""

    def run_until_stopped(self) -> int:
        """Serve until stopped: 0, or 130 if a second signal cut the shutdown short."""
        with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises the signal at its end
            self.run()
        return CUT_SHORT if self.cut_short else 0
