"""AsyncLLMEngine: the engine loop on its own thread, requests as async iterators."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass

from prefixcache.cache.retention import Keep
from prefixcache.engine.compute_threads import release_pool
from prefixcache.engine.engine import LLMEngine
from prefixcache.engine.request import RequestOutput
from prefixcache.engine.sampling_params import SamplingParams

log = logging.getLogger("prefixcache.engine")
IDLE_REFRESH_SECONDS = 1.0  # with a tier, an idle engine republishes this often
# An idle engine handed a long prompt to compute waits this long for requests that arrive
# with it (each arrival restarts the wait, up to COALESCE_LIMIT_SECONDS), so that a burst
# sharing a document computes it in one step instead of once alone and once for the rest.
# A prompt whose prefix is cached does not wait: there is little left to share.
COALESCE_PROMPT_TOKENS = 256
COALESCE_SECONDS = 0.005
COALESCE_LIMIT_SECONDS = 0.05


class EndedByShutdown(RuntimeError):
    """A request ended by a stopping server's deadline (``end_all``), not by a failure."""


@dataclass(slots=True)
class AddRequest:
    """Queue a request (the arguments of ``LLMEngine.add_request``, by name)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    min_hit_tokens: int = 0
    zero_on_evict: bool = False
    use_tier: bool = True
    owner: str | None = None
    previous_cache_salt: str | None = None
    retention: tuple[Keep, ...] = ()  # prompt prefixes to keep cached (cache controls)
    cache_key: str | None = None  # an opaque per-tenant id, for traces and logs only
    priority: int = 0  # lower is scheduled first


@dataclass(slots=True)
class AbortRequest:
    """Stop a request and free its blocks."""

    request_id: str


@dataclass(slots=True)
class CallInEngine:
    """Run ``function(engine)`` between two steps."""

    function: Callable[[LLMEngine], object]


Command = AddRequest | AbortRequest | CallInEngine


class RequestStream:
    """One request's snapshots as an async iterator; closing it early aborts the request."""

    def __init__(self, owner: AsyncLLMEngine, request_id: str, queue: asyncio.Queue) -> None:
        self.owner, self.request_id, self._queue = owner, request_id, queue
        self._closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._closed:
            raise StopAsyncIteration
        output = await self._queue.get()
        if isinstance(output, BaseException):
            self.close()
            raise output
        if output.finished:
            self.close()
        return output

    def close(self) -> None:
        """Stop listening; abort the request if it is still in the engine (safe to repeat)."""
        if not self._closed:
            self._closed = True
            self.owner._release(self.request_id)

    async def aclose(self) -> None:
        self.close()


class AsyncLLMEngine:
    """Steps the engine on a background thread; the event loop never waits on a step.

    Other threads (metrics) read only ``engine.snapshot``: the engine thread publishes it
    after each step and each batch of commands, before their callers hear back, and now and
    then while idle with a tier.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._held: list[tuple[Future, Command]] = []  # taken during a long step, not run yet
        engine.between.arrivals = self._take_arrivals
        engine.between.on_outputs = self._deliver_all

    def start(self) -> None:
        """Start the engine thread, delivering to the running event loop."""
        self._loop = asyncio.get_running_loop()
        release_pool()  # this thread built the model; only the engine thread computes now
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """Stop the engine thread after the current step; abort what is left, free its blocks."""
        self._stopped = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        if self._thread is None or not self._thread.is_alive():
            left = list(self.engine.requests)
            for request_id in left:
                self.engine.abort_request(request_id)
            if left:
                log.info("shutdown aborted %d unfinished requests", len(left))
            self._publish()  # the engine thread is gone: this thread is the engine's only user
        self.engine.close()

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        min_hit_tokens: int = 0,
        zero_on_evict: bool = False,
        use_tier: bool = True,
        owner: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Snapshots of the request as it advances; the last one has ``finished``.

        Raises the engine's ValueError at once for a request it can never serve.
        Closing the iterator early (a client that went away) aborts the request.
        """
        add = AddRequest(
            request_id, prompt_token_ids, params, cache_salt, min_hit_tokens, zero_on_evict,
            use_tier, owner,
        )  # fmt: skip
        stream = await self.open(add)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    def open(self, add: AddRequest) -> Coroutine[None, None, RequestStream]:
        """Add a request (awaiting raises the engine's ValueError); then its snapshots.

        It counts in ``num_pending`` from this call on. Opening several at once
        (``asyncio.gather``) puts them in the engine between the same two steps, so requests
        that share a prefix compute it once.
        """
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[add.request_id] = queue
        return self._added(add, queue)

    async def _added(self, add: AddRequest, queue: asyncio.Queue) -> RequestStream:
        try:
            await self._call(add)
        except BaseException:  # refused, or cancelled while queued (then it may still land)
            self._streams.pop(add.request_id, None)
            self._submit(AbortRequest(add.request_id))
            raise
        return RequestStream(self, add.request_id, queue)

    def _release(self, request_id: str) -> None:
        """A stream was closed: stop delivering to it, abort the request if it still runs.

        It may run while cancelled (client gone): it submits, never awaits."""
        self._streams.pop(request_id, None)
        if request_id in self.engine.requests:
            self._submit(AbortRequest(request_id))

    async def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks."""
        await self._call(AbortRequest(request_id))

    async def run_in_engine(self, function: Callable[[LLMEngine], object]) -> object:
        """Run ``function(engine)`` on the engine thread between two steps."""
        return await self._call(CallInEngine(function))

    def end_all(self, reason: str) -> None:
        """Abort every request between two steps and end each open stream with
        ``EndedByShutdown(reason)`` (a draining server's deadline: streams get an error event)."""
        self._submit(CallInEngine(lambda engine: self._end_all(engine, reason)))

    def _end_all(self, engine: LLMEngine, reason: str) -> None:
        for request_id in list(engine.requests):
            engine.abort_request(request_id)
        for request_id in list(self._streams):
            self._deliver(EndedByShutdown(reason), request_id)

    @property
    def num_pending(self) -> int:
        """Requests in the engine or on their way to it."""
        return len(self._streams)

    def _submit(self, command: Command) -> Future:
        future: Future = Future()
        self._commands.put((future, command))
        self._wake.set()
        return future

    async def _call(self, command: Command) -> object:
        return await asyncio.wrap_future(self._submit(command))

    def _run(self) -> None:
        woke = False
        while not self._stopped:
            longest = self._drain_commands()
            if woke and longest >= COALESCE_PROMPT_TOKENS:
                self._coalesce()
            woke = False
            if not self.engine.has_unfinished_requests():
                self._idle()
                woke = True
                continue
            try:
                outputs = self.engine.step()
            except Exception as error:  # a broken step must not leave requests hanging
                log.exception("engine step failed; its requests were aborted")
                self._publish()
                self._fail_all(error)
                continue
            self._publish()  # before delivering: a client that heard back sees this step
            for output in outputs:
                self._deliver(output)

    def _publish(self) -> None:
        """Publish the engine's snapshot (``LLMEngine.snapshot``)."""
        try:
            self.engine.publish_snapshot()
        except Exception:  # stale numbers, never a dead engine thread
            log.exception("engine snapshot failed; metrics keep the previous one")

    def _idle(self) -> None:
        """Wait for work; with a tier, republish now and then (its writer thread and breaker
        move on while the engine waits)."""
        refresh = None if self.engine.tier is None else IDLE_REFRESH_SECONDS
        while not self._wake.wait(refresh):
            self._publish()
        self._wake.clear()

    def _coalesce(self) -> None:
        """Take in the requests that arrive within `COALESCE_SECONDS` of each other."""
        deadline = time.monotonic() + COALESCE_LIMIT_SECONDS
        while not self._stopped and time.monotonic() < deadline:
            if not self._wake.wait(COALESCE_SECONDS):
                return
            self._wake.clear()
            self._drain_commands()

    def _take_arrivals(self) -> None:
        """Between a long step's layers: add the requests that arrived; other commands
        (aborts, calls) wait for the step's end, as it may be computing their blocks."""
        self._drain_commands(adds_only=True)

    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        """An urgent step's outputs, during a long step: published and delivered now."""
        self._publish()
        for output in outputs:
            self._deliver(output)

    def _queued(self) -> list[tuple[Future, Command]]:
        """Commands held back, then those queued since, in order; none are left."""
        taken, self._held = self._held, []
        while True:
            try:
                taken.append(self._commands.get_nowait())
            except queue.Empty:
                return taken

    def _drain_commands(self, adds_only: bool = False) -> int:
        """Run queued adds, aborts and calls, between steps, on the engine thread; publish
        once, then answer their callers. The most prompt tokens an add left to compute. With
        ``adds_only``, other commands are held for the next drain."""
        settled, longest = [], 0
        for future, command in self._queued():
            if adds_only and not isinstance(command, AddRequest):
                self._held.append((future, command))
                continue
            try:
                settled.append((future, command, self._execute(command), None))
            except Exception as failure:
                settled.append((future, command, None, failure))
            if isinstance(command, AddRequest):
                longest = max(longest, self._to_compute(command))
        if settled:
            self._publish()
        for future, command, result, error in settled:
            if isinstance(command, AbortRequest) and result is not None:
                self._deliver(result)  # the aborted request's last snapshot
            _settle(future, result, error)
        return longest

    def _to_compute(self, add: AddRequest) -> int:
        """The prompt tokens an added request leaves to compute (0 if it was refused); a
        short prompt's whole length, unlooked."""
        if len(add.prompt_token_ids) < COALESCE_PROMPT_TOKENS:
            return len(add.prompt_token_ids)
        if add.request_id not in self.engine.requests:
            return 0
        return self.engine.uncached_tokens(add.request_id)

    def _execute(self, command: Command) -> object:
        """Carry out one command on the engine thread."""
        if isinstance(command, AddRequest):
            self.engine.add_request(
                command.request_id,
                command.prompt_token_ids,
                command.params,
                cache_salt=command.cache_salt,
                min_hit_tokens=command.min_hit_tokens,
                zero_on_evict=command.zero_on_evict,
                use_tier=command.use_tier,
                owner=command.owner,
                previous_cache_salt=command.previous_cache_salt,
                retention=command.retention,
                cache_key=command.cache_key,
                priority=command.priority,
            )
            return None
        if isinstance(command, AbortRequest):
            return self.engine.abort_request(command.request_id)
        return command.function(self.engine)

    def _deliver(self, item: RequestOutput | BaseException, request_id: str = "") -> None:
        stream = self._streams.get(request_id or item.request_id)  # type: ignore[union-attr]
        if stream is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(stream.put_nowait, item)

    def _fail_all(self, error: Exception) -> None:
        """Tell every open stream that the step failed (the engine already aborted them)."""
        for request_id in list(self._streams):
            self._deliver(RuntimeError(f"engine step failed: {error}"), request_id)


def _settle(future: Future, result: object, error: Exception | None) -> None:
    """Hand a command's result or error to its caller, if it still waits."""
    try:
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
    except InvalidStateError:  # the caller was cancelled and no longer waits
        pass
