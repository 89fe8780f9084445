"""Several engine requests read as one: the prompts of a batched completion request."""

from __future__ import annotations

import asyncio

from prefixcache.engine.async_engine import EndedByShutdown, RequestStream
from prefixcache.engine.request import RequestOutput
from prefixcache.protocol.errors import stream_error_event


class FanIn:
    """Snapshots of each part as they come, ``(part, output)``; closing aborts the rest."""

    def __init__(self, streams: list[RequestStream]) -> None:
        self.streams = streams
        self.latest: list[RequestOutput | None] = [None] * len(streams)
        self._queue: asyncio.Queue = asyncio.Queue()
        self._pumps = [asyncio.ensure_future(self._pump(i, s)) for i, s in enumerate(streams)]

    async def _pump(self, part: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                self._queue.put_nowait((part, output))
        except Exception as error:  # the engine step failed: the reader raises it
            self._queue.put_nowait((part, error))

    @property
    def finished(self) -> bool:
        return all(output is not None and output.finished for output in self.latest)

    async def next(self) -> tuple[int, RequestOutput]:
        """The next snapshot of any part (raises a part's engine error)."""
        part, item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        self.latest[part] = item
        return part, item

    def finals(self) -> list[RequestOutput]:
        """Every part's last snapshot (all of them, once ``finished``)."""
        return [output for output in self.latest if output is not None]

    def close(self) -> None:
        """Stop reading; every part still in the engine is aborted (safe while cancelled)."""
        for pump in self._pumps:
            pump.cancel()
        for stream in self.streams:
            stream.close()


def failure_event(error: RuntimeError, path: str | None = None) -> str:
    """The SSE event ending a stream whose requests raised ``error``: a 503 when the
    server's shutdown deadline ended them (Anthropic's ``overloaded_error``), else a 500."""
    status = 503 if isinstance(error, EndedByShutdown) else 500
    return stream_error_event(status, str(error), path)
