"""A bounded thread pool for request preparation, so the event loop never parses or tokenizes."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from typing import TypeVar

import anyio
import anyio.to_thread

T = TypeVar("T")
NICENESS = 10  # preparation yields the cores to the engine's forward passes


class PreparePool:
    """Runs at most ``size`` preparations at once in worker threads; the rest wait their turn.

    A preparation that has started runs to its end even if its client leaves (it is bounded
    by the body and prompt limits), so a cancelled waiter never leaves a thread behind. Its
    thread runs at a lower priority (``NICENESS``): a flood of bodies to parse takes the
    cores only while the engine leaves them idle.
    """

    def __init__(self, size: int) -> None:
        self._limiter = anyio.CapacityLimiter(size)

    async def run(self, function: Callable[..., T], *args: object) -> T:
        return await anyio.to_thread.run_sync(_yielding, function, *args, limiter=self._limiter)

    @property
    def busy(self) -> int:
        """Preparations running now."""
        return int(self._limiter.borrowed_tokens)


def _yielding(function: Callable[..., T], *args: object) -> T:
    """``function(*args)`` on this worker thread, lowered to ``NICENESS`` first (Linux)."""
    with contextlib.suppress(AttributeError, OSError):  # no per-thread priority: run as is
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICENESS)
    return function(*args)
