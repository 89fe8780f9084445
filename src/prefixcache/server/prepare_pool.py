"""A bounded thread pool for request preparation, so the event loop never parses or tokenizes."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import anyio
import anyio.to_thread

T = TypeVar("T")


class PreparePool:
    """Runs at most ``size`` preparations at once in worker threads; the rest wait their turn.

    A preparation that has started runs to its end even if its client leaves (it is bounded
    by the body and prompt limits), so a cancelled waiter never leaves a thread behind.
    """

    def __init__(self, size: int) -> None:
        self._limiter = anyio.CapacityLimiter(size)

    async def run(self, function: Callable[..., T], *args: object) -> T:
        return await anyio.to_thread.run_sync(function, *args, limiter=self._limiter)

    @property
    def busy(self) -> int:
        """Preparations running now."""
        return int(self._limiter.borrowed_tokens)
