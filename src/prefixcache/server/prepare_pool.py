"""Request preparation off the event loop: threads for small bodies, processes for large ones.

A thread that parses a 4 MiB body holds the GIL for tens of milliseconds, and while it is
descheduled (it runs at a lower priority) the engine thread waits for the GIL at every
torch op: a decode step slows down many times over. Bodies of ``PROCESS_BODY_BYTES`` or
more are therefore prepared in worker processes with their own GIL; small bodies, whose
parse is shorter than a process round trip, stay on threads.

Stopping never waits on a worker: the context goes to the workers through a private file
(the spawn handshake then fits the pipe buffer, so a worker that a group signal killed
mid-start cannot block its parent), workers start with SIGINT blocked (a terminal's Ctrl-C
is their parent's to handle), and ``close`` terminates, then kills, within its deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import pickle
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import TYPE_CHECKING, TypeVar

import anyio
import anyio.to_thread

from prefixcache.shutdown import kill_all, sigint_blocked

if TYPE_CHECKING:
    from prefixcache.server.prepare import PrepareContext, Prepared

T = TypeVar("T")
log = logging.getLogger(__name__)
NICENESS = 10  # preparation yields the cores to the engine's forward passes
PROCESS_BODY_BYTES = 64 * 2**10  # bodies at least this large are prepared in a process
PREPARE_PROCESSES = 2  # worker processes, started at the first large body (or by warm())
PARENT_POLL_SECONDS = 1.0  # how often a worker checks that its server is still there
WARM_QUIET_SECONDS = 1.0  # a server's engine idle this long lets its workers start (warm)
CLOSE_TIMEOUT_SECONDS = 2.0  # close(): workers that ignore SIGTERM this long are killed

Prepare = Callable[[bytes, "PrepareContext"], "Prepared"]


class PreparePool:
    """Runs at most ``size`` preparations at once; the rest wait their turn.

    A preparation that has started runs to its end even if its client leaves (it is bounded
    by the body and prompt limits), so a cancelled waiter never leaves a worker behind.
    Workers run at a lower priority (``NICENESS``): a flood of bodies to parse takes the
    cores only while the engine leaves them idle. If a worker process dies, its request
    is prepared on a thread instead and the next large body starts new workers.
    """

    def __init__(
        self, size: int, processes: int = PREPARE_PROCESSES, process_bytes: int = PROCESS_BODY_BYTES
    ) -> None:
        self._limiter = anyio.CapacityLimiter(size)
        self._processes, self.process_bytes = processes, process_bytes
        self._executor: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()
        self._context_file: str | None = None  # the pickled PrepareContext the workers read
        self._closed = False

    async def run(self, function: Callable[..., T], *args: object) -> T:
        """``function(*args)`` on a worker thread."""
        return await anyio.to_thread.run_sync(_yielding, function, *args, limiter=self._limiter)

    async def prepare(self, function: Prepare, raw: bytes, ctx: PrepareContext) -> Prepared:
        """``function(raw, ctx)``: in a worker process if ``raw`` is large, else on a thread."""
        if len(raw) < self.process_bytes or self._processes < 1:
            return await self.run(function, raw, ctx)
        async with self._limiter:
            future = self._submit(function, raw, ctx)
            ready = None if future is None else await self._result(future)
            if ready is None:  # no worker took it, or its worker died: a thread (same token)
                return await anyio.to_thread.run_sync(_yielding, function, raw, ctx)
        ready.shape.tokenizer = ctx.tokenizer  # the worker sends the shape without it
        return ready

    async def _result(self, future: Future) -> Prepared | None:
        """The worker's answer (its ApiError raised here); None if the worker died."""
        try:
            return await asyncio.wrap_future(future)
        except BrokenProcessPool:
            self._discard()  # the next large body starts new workers
            return None

    def warm(
        self, ctx: PrepareContext, busy: Callable[[], bool] | None = None, quiet: float = 0.0
    ) -> None:
        """Start the worker processes from a thread, not at the first large body: now, or,
        given `busy`, once it has been False for `quiet` seconds, so that the workers'
        imports (~0.4 s of CPU each) never compete with a new server's first requests. A
        large body before that starts them on demand, as without warming."""

        def wait_then_warm() -> None:
            idle_since = time.monotonic()
            while busy is not None and time.monotonic() - idle_since < quiet:
                time.sleep(quiet / 4)
                if busy():
                    idle_since = time.monotonic()
            self._warm(ctx)

        if self._processes:
            threading.Thread(target=wait_then_warm, name="prepare-warm", daemon=True).start()

    def _warm(self, ctx: PrepareContext) -> None:
        log.info("prepare workers starting: %d processes", self._processes)
        try:
            pool = self._pool(ctx)
            with sigint_blocked():
                pool.submit(os.getpid)  # the first submit starts every worker
        except (RuntimeError, OSError, BrokenProcessPool) as error:  # closed meanwhile
            log.info("prepare workers not started early: %s", error)

    def worker_pids(self) -> list[int]:
        """Process ids of the live worker processes."""
        pool = self._executor
        return [] if pool is None else list(pool._processes or {})

    def close(self, timeout: float = CLOSE_TIMEOUT_SECONDS) -> None:
        """Stop the worker processes for good (queued work is dropped: the server is going
        away): SIGTERM, SIGKILL after ``timeout``; no worker starts after this. The context
        file goes first: a worker starting meanwhile, or missed here, sees it gone and exits."""
        with self._lock:
            self._closed = True
            name, self._context_file = self._context_file, None
        if name is not None:
            with contextlib.suppress(OSError):
                os.unlink(name)
        self._discard(timeout)

    @property
    def busy(self) -> int:
        """Preparations running now."""
        return int(self._limiter.borrowed_tokens)

    def _submit(self, function: Prepare, raw: bytes, ctx: PrepareContext) -> Future | None:
        """The body handed to a worker process; None if none can take it (use a thread)."""
        for _ in range(2):  # a pool that a dead worker broke is replaced, once
            try:
                pool = self._pool(ctx)
                with sigint_blocked():  # a worker it starts inherits the mask
                    return pool.submit(_in_worker, function, raw)
            except BrokenProcessPool:
                log.warning("a prepare worker process died; starting new ones")
                self._discard()
            except (RuntimeError, OSError) as error:  # e.g. an unguarded __main__ under spawn
                if self._closed:  # shutting down: the thread finishes what was admitted
                    return None
                log.warning("prepare worker processes cannot start (%s); using threads", error)
                self._processes = 0
                return None
        return None

    def _pool(self, ctx: PrepareContext) -> ProcessPoolExecutor:
        with self._lock:
            if self._closed:
                raise RuntimeError("the prepare pool is closed")
            if self._context_file is None:
                self._context_file = _write_context(ctx)
            if self._executor is None:
                self._executor = _EagerProcessPool(
                    self._processes,
                    mp_context=multiprocessing.get_context("spawn"),  # never fork a threaded server
                    initializer=_start_worker,
                    initargs=(self._context_file, os.getpid()),  # a path: a small handshake
                )
            return self._executor

    def _discard(self, timeout: float = CLOSE_TIMEOUT_SECONDS) -> None:
        with self._lock:
            pool, self._executor = self._executor, None
        if pool is None:
            return
        processes = list((pool._processes or {}).values())
        stopper = threading.Thread(  # it takes the lock a worker's start holds: never wait on it
            target=pool.shutdown, kwargs={"wait": False, "cancel_futures": True}, daemon=True
        )
        stopper.start()
        stopper.join(timeout)
        kill_all(processes, timeout)  # a preparation is bounded, but nobody awaits it now


class _EagerProcessPool(ProcessPoolExecutor):
    """Starts all its workers at the first submit, before its manager thread watches them.

    Under spawn, CPython 3.11 starts a worker per submit, while the manager thread runs: a
    worker a group signal killed then made that thread iterate the worker dict as the next
    submit grew it ("dictionary changed size during iteration", a traceback at Ctrl-C)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._safe_to_dynamically_spawn_children = False  # as under fork: all at once, first


def _yielding(function: Callable[..., T], *args: object) -> T:
    """``function(*args)`` on this worker thread, lowered to ``NICENESS`` first (Linux)."""
    with contextlib.suppress(AttributeError, OSError):  # no per-thread priority: run as is
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICENESS)
    return function(*args)


_worker_ctx: PrepareContext | None = None  # a worker process's copy, set by _start_worker


def _write_context(ctx: PrepareContext) -> str:
    """``ctx`` pickled into a new private (0600) file; its path. Handed to a worker as is, the
    context (1.5 MB with its tokenizer) overflows the spawn pipe, and its parent's write
    blocks forever if the worker dies before reading it."""
    descriptor, name = tempfile.mkstemp(prefix="prefixcache-prepare-", suffix=".pickle")
    with os.fdopen(descriptor, "wb") as file:
        pickle.dump(ctx, file, protocol=pickle.HIGHEST_PROTOCOL)
    return name


def _start_worker(context_file: str, server_pid: int) -> None:
    """A worker process starts: lower its priority, read the context, and watch its server
    (a server that exits without closing its pool leaves no orphans)."""
    global _worker_ctx
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, 0, NICENESS)
    try:
        with open(context_file, "rb") as file:
            _worker_ctx = pickle.load(file)
    except OSError:  # the pool closed while this worker started: nothing to do
        os._exit(0)
    threading.Thread(target=_exit_with, args=(server_pid, context_file), daemon=True).start()


def _exit_with(server_pid: int, context_file: str) -> None:
    """Exit this worker process once its server process is gone (it was re-parented) or
    has closed the pool (the context file is gone)."""
    while os.getppid() == server_pid and os.path.exists(context_file):
        time.sleep(PARENT_POLL_SECONDS)
    os._exit(0)


def _in_worker(function: Prepare, raw: bytes) -> Prepared:
    """``function(raw)`` in a worker process; the tokenizer stays here (the server has its own)."""
    assert _worker_ctx is not None, "the worker's initializer did not run"
    ready = function(raw, _worker_ctx)
    ready.shape.tokenizer = None  # type: ignore[assignment]
    return ready
