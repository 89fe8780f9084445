"""The server's KV-event publisher: batches the cache's events on a thread, publishes them on
a ZMQ PUB socket and answers replays on a ROUTER socket, in the wire format of
``protocol/kv_events.py`` (vLLM's). Binds only to loopback unless told otherwise.

Nothing a peer sends stops it: replay requests are checked (``event_replay.py``), the
sockets refuse large frames (``event_sockets.py``), and a failure of the thread's loop is
counted, logged in one line and the loop restarted (``event_health.py`` says when events
are down). Events that could not be published start a new epoch, so that no consumer keeps
a view with a hole in it.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
from collections import deque

import zmq

from prefixcache.cache.events import BlockStored, EventSink, KVEvent
from prefixcache.protocol.kv_events import check_topic, encode_batch
from prefixcache.server.event_health import EventsCollector, EventsHealth
from prefixcache.server.event_replay import ReplayServer
from prefixcache.server.event_sockets import (
    ALLOW_REMOTE_FLAG,
    bind_pub,
    bind_replay,
    check_bind_allowed,
    is_loopback_endpoint,
)

__all__ = [
    "ALLOW_REMOTE_FLAG",
    "DEFAULT_ENDPOINT",
    "KVEventPublisher",
    "check_bind_allowed",
    "is_loopback_endpoint",
    "sink_for",
]

log = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"
CLOSE_LINGER_MS = 200  # how long close() lets queued frames drain to subscribers


# --- publisher ---------------------------------------------------------------------


class KVEventPublisher:
    """Batches cache events on a background thread and publishes them over ZMQ.

    ``publish`` only appends to a queue, so the engine thread never waits on I/O. The
    thread sends a batch every ``flush_interval_s`` (sooner when ``max_batch_events``
    are waiting), keeps the last ``buffer_batches`` for replay and serves the replay
    socket. Sockets are bound here, so a bad endpoint fails at construction.
    """

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        replay_endpoint: str | None = None,
        *,
        topic_prefix: str = "kv-events",
        topic: str | None = None,
        wire_format: str = "array",
        buffer_batches: int = 10_000,
        max_batch_events: int = 1024,
        flush_interval_s: float = 0.005,
        max_queue_events: int = 1_000_000,
        dp_rank: int | None = None,
        allow_remote: bool = False,
    ) -> None:
        for ep in (endpoint, replay_endpoint):
            if ep is not None:
                check_bind_allowed(ep, allow_remote)
        assert buffer_batches > 0 and max_batch_events > 0 and flush_interval_s > 0
        encode_batch(0.0, [], wire_format=wire_format)  # an unknown format fails here
        self._topic_prefix = topic_prefix
        self._fixed_topic = None if topic is None else check_topic(topic)
        self.wire_format = wire_format
        self._max_batch_events = max_batch_events
        self._max_queue_events = max_queue_events
        self._tick_ms = max(1, round(flush_interval_s * 1000))
        self._dp_rank = dp_rank
        self._queue: deque[KVEvent] = deque()
        self._unsent: list[KVEvent] = []  # a batch taken from the queue, not published yet
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self.batches_sent = self.events_sent = self.events_dropped = 0
        self.epochs = 0
        self._start_epoch()
        self._drops_seen = 0  # events_dropped when this epoch began
        self.health_state = EventsHealth()
        self._step, self._broken = "poll", False
        self._open_sockets(endpoint, replay_endpoint, buffer_batches)
        self._closed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events-pub", daemon=True)
        self._thread.start()

    def _open_sockets(self, endpoint: str, replay_endpoint: str | None, buffer: int) -> None:
        """Bind PUB and (optionally) ROUTER; expose the endpoints actually bound."""
        # A context of our own: close() terms it, so the ports are free when it returns
        # (socket teardown is otherwise asynchronous and a quick restart could not rebind).
        self._ctx = ctx = zmq.Context(io_threads=1)
        self._buffer_batches = buffer
        self._replays: ReplayServer | None = None
        try:
            self._pub = bind_pub(ctx, endpoint)
            if replay_endpoint is not None:
                self._replays = ReplayServer(
                    bind_replay(ctx, replay_endpoint, buffer), self.health_state
                )
        except zmq.ZMQError:
            ctx.destroy(linger=0)
            raise
        self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint: str | None = (
            self._replays.sock.getsockopt_string(zmq.LAST_ENDPOINT) if self._replays else None
        )

    def _start_epoch(self) -> None:
        """A new random topic (or the fixed one) counting from 0, and an empty replay buffer."""
        self.epoch = secrets.randbits(64)
        self.topic = self._fixed_topic or f"{self._topic_prefix}.{self.epoch:016x}"
        self._topic_bytes = self.topic.encode()
        self._next_seq = 0
        self._buffer.clear()
        self.epochs += 1

    # -- engine side --

    def publish(self, event: KVEvent) -> None:
        """Queue one event (thread-safe, O(1)); dropped and counted once closed or full."""
        if self._closed or len(self._queue) >= self._max_queue_events:
            if self.events_dropped == 0:
                log.warning("KV events publisher dropping events (closed or queue full)")
            self.events_dropped += 1
            return
        self._queue.append(event)

    def close(self, timeout_s: float = 2.0) -> None:
        """Flush what is queued, stop the thread, close the sockets and free the ports."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("KV events publisher thread did not stop in %.1fs", timeout_s)
            return  # its sockets are still in use: leave them to the daemon thread
        self._pub.close(linger=CLOSE_LINGER_MS)
        if self._replays is not None:
            self._replays.sock.close(linger=0)
        self._ctx.term()  # returns once queued frames drained (bounded by the linger)
        log.info(
            "KV events socket closed after its last batch: %d sent, topic %s ends at seq %d",
            self.batches_sent, self.topic, self._next_seq - 1,
        )  # fmt: skip

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- health (any thread) --

    @property
    def replays_served(self) -> int:
        """Replay requests answered with batches (malformed ones are in ``health_state``)."""
        return 0 if self._replays is None else self._replays.served

    @property
    def up(self) -> bool:
        """Publishing: the thread runs and its loop has not failed too often in a row."""
        return not self.health_state.down and (self._closed or self._thread.is_alive())

    def health(self) -> dict:
        """The ``kv_events`` object of ``/health``: where, which epoch, and whether up."""
        return {
            "endpoint": self.endpoint,
            "replay": self.replay_endpoint,
            "topic": self.topic,
            "format": self.wire_format,
            "status": "ok" if self.up else "down",
            "failures": sum(self.health_state.failures.values()),
        }

    def collector(self) -> EventsCollector:
        """A Prometheus collector of this publisher's numbers (failures, rejections, up)."""
        return EventsCollector(self)

    # -- publisher thread --

    def _run(self) -> None:
        """Run the loop until close(); any failure is counted and the loop restarted."""
        while True:
            try:
                self._loop()
                return
            except Exception as exc:
                if not self._recover(exc):
                    return

    def _loop(self) -> None:
        """Wait a tick (or a replay request), serve replays, send what is queued; repeat."""
        while not (self._stop.is_set() and not self._queue and not self._unsent):
            if self._broken:
                self._step = "sockets"
                self._reopen_sockets()
            self._step = "poll"
            backlog = len(self._queue) >= self._max_batch_events
            self._wait(0 if backlog else self._tick_ms)
            self._step = "replay"
            if self._replays is not None:
                self._replays.serve_waiting(self._buffer, self._next_seq)
            self._step = "publish"
            self._send_queued()
            if self.health_state.round_ok():
                log.warning("KV events are up again (topic %s)", self.topic)

    def _recover(self, exc: Exception) -> bool:
        """Count and log one failure, then pause before a restart; False once closing."""
        state = self.health_state
        was_down, pause = state.down, state.failed(self._step)
        n = state.in_a_row
        if not was_down or n & (n - 1) == 0:  # once down, at the 8th, 16th... in a row only
            log.error(
                "KV events publisher: its %s step failed (%s), %d in a row; restarting its loop%s",
                self._step,
                _describe(exc),
                n,
                "; KV events are down" if state.down and not was_down else "",
            )
        if self._stop.is_set():  # closing: what cannot go out now never will
            self._drop(len(self._unsent) + len(self._queue))
            return False
        if isinstance(exc, zmq.ZMQError) or self._step == "sockets":
            self._broken = True
            self._close_sockets()
        self._stop.wait(pause)
        return True

    def _close_sockets(self) -> None:
        """Close both sockets at once (a broken one), so their ports are free after the pause."""
        self._pub.close(linger=0)
        if self._replays is not None:
            self._replays.sock.close(linger=0)

    def _reopen_sockets(self) -> None:
        """Bind a new socket for each closed one, on the endpoint the old one had."""
        if self._pub.closed:
            self._pub = bind_pub(self._ctx, self.endpoint)
        if self._replays is not None and self._replays.sock.closed:
            assert self.replay_endpoint is not None
            sock = bind_replay(self._ctx, self.replay_endpoint, self._buffer_batches)
            self._replays.rebind(sock)
        self._broken = False
        log.warning("KV events publisher: sockets bound again on %s", self.endpoint)

    def _wait(self, timeout_ms: int) -> None:
        """Sleep up to ``timeout_ms``, waking early for a replay request."""
        if self._replays is not None:
            self._replays.sock.poll(timeout_ms)
        elif timeout_ms:
            time.sleep(timeout_ms / 1000)

    def _drop(self, count: int) -> None:
        """Count events that will never be published (the next batch starts a new epoch)."""
        self.events_dropped += count

    def _send_queued(self) -> None:
        """Drain the queue in batches of at most ``max_batch_events``; a failed one first."""
        while self._unsent or self._queue:
            if not self._unsent:
                n = min(len(self._queue), self._max_batch_events)
                self._unsent = [self._queue.popleft() for _ in range(n)]
            self._send_batch(self._unsent)
            self._unsent = []

    def _send_batch(self, events: list[KVEvent]) -> None:
        """Encode, number, send and buffer one batch (a new epoch first if events were lost)."""
        try:
            payload = encode_batch(time.time(), events, self._dp_rank, self.wire_format)
        except (TypeError, ValueError) as exc:  # never log the events: they may hold tokens
            log.error(
                "dropping %d KV events that failed to encode (%s)", len(events), _describe(exc)
            )
            self._drop(len(events))
            return
        if self.events_dropped != self._drops_seen and not self._closed:
            self._epoch_after_loss()
        seq = self._next_seq
        self._pub.send_multipart([self._topic_bytes, seq.to_bytes(8, "big"), payload])
        self._next_seq += 1
        self._buffer.append((seq, payload))
        self.batches_sent += 1
        self.events_sent += len(events)

    def _epoch_after_loss(self) -> None:
        """Events were dropped: a new epoch, so consumers drop what they knew and start over."""
        lost = self.events_dropped - self._drops_seen
        self._drops_seen = self.events_dropped
        self._start_epoch()
        log.warning("KV events: %d events dropped; new epoch, topic %s", lost, self.topic)


def _describe(exc: BaseException) -> str:
    """An exception's type (and a socket error's reason), never its message: it may hold data."""
    if isinstance(exc, zmq.ZMQError):
        return f"{type(exc).__name__}: {exc.strerror}"
    return type(exc).__name__


def sink_for(publisher: KVEventPublisher, *, include_token_ids: bool) -> EventSink:
    """An ``EventSink`` feeding ``publisher``; token ids (the prompt) are stripped unless asked."""
    if include_token_ids:
        return publisher.publish

    def publish_without_tokens(event: KVEvent) -> None:
        if isinstance(event, BlockStored) and event.token_ids:
            event = dataclasses.replace(event, token_ids=[])
        publisher.publish(event)

    return publish_without_tokens
