"""A stopping router: requests that come after the first signal get a 503; streams and
answers still running a little before the shutdown deadline are cut, each stream ending
with an error event in its route's shape (as a replica's do), each answer with a 503.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

import uvicorn

from prefixcache.protocol.stopping_server import StoppingServer

ROUTER_SHUTTING_DOWN = "the router is shutting down; retry shortly"
T = TypeVar("T")


class Cut(Exception):
    """The shutdown deadline came before what was awaited."""


class Drain:
    """Whether the router is stopping, and the event that cuts what still runs."""

    def __init__(self) -> None:
        self.draining = False
        self._cut: asyncio.Future | None = None  # done at the deadline

    def attach(self) -> None:
        """Bind to the running event loop (the app's lifespan calls it)."""
        self._cut = asyncio.get_running_loop().create_future()

    def cut_all(self) -> None:
        """End what still runs (from any thread, e.g. the deadline's timer)."""
        cut = self._cut
        if cut is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                cut.get_loop().call_soon_threadsafe(_set_done, cut)

    async def unless_cut(self, awaitable: Awaitable[T]) -> T:
        """``awaitable``'s result; ``Cut`` if the deadline comes first (it is then cancelled
        and awaited, so nothing of it runs on)."""
        if self._cut is None:  # not attached: no deadline
            return await awaitable
        if self._cut.done():
            if asyncio.iscoroutine(awaitable):
                awaitable.close()  # never started: not "never awaited"
            raise Cut
        work = asyncio.ensure_future(awaitable)
        try:
            await asyncio.wait({work, self._cut}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not work.done():
                work.cancel()
                await asyncio.wait({work})  # raises nothing, even if ours is cancelled
        if work.cancelled():
            raise Cut
        return work.result()

    async def chunks(self, source: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """``source``'s chunks as they come; ``Cut`` at the deadline (the read is cancelled)."""
        while True:
            chunk = await self.unless_cut(anext(source, None))
            if chunk is None:
                return
            yield chunk


def _set_done(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class DrainingServer(StoppingServer):
    """``StoppingServer`` for the router: the first signal starts ``drain``, which cuts what
    still runs shortly before the graceful part ends."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config, hard_deadline=True)
        self.drain = drain

    def on_first_signal(self) -> None:
        self.drain.draining = True
        self.before_the_deadline(self.drain.cut_all)
