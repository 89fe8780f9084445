"""The server's KV-event publisher: batches the cache's events on a thread, publishes them on
a ZMQ PUB socket and answers replays on a ROUTER socket, in the wire format of
``protocol/kv_events.py`` (vLLM's). Binds only to loopback unless told otherwise.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import itertools
import logging
import secrets
import threading
import time
from collections import deque

import zmq

from prefixcache.cache.events import BlockStored, EventSink, KVEvent
from prefixcache.protocol.kv_events import END_SEQ, encode_batch

log = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"
ALLOW_REMOTE_FLAG = "--kv-events-allow-remote"
PUB_HWM = 100_000  # messages queued per subscriber before ZMQ drops (vLLM's default)
CLOSE_LINGER_MS = 200  # how long close() lets queued frames drain to subscribers
MAX_REPLAYS_PER_TICK = 8  # replay requests served between two flushes of the queue


# --- endpoints ---------------------------------------------------------------------


def is_loopback_endpoint(endpoint: str) -> bool:
    """True for ipc/inproc and tcp on 127.0.0.0/8, ::1 or localhost; False for ``*``."""
    scheme, _, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    host = rest.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", an interface name or a host name: could be any address


def check_bind_allowed(endpoint: str, allow_remote: bool) -> None:
    """Refuse a non-loopback bind unless the operator opted in."""
    if allow_remote or is_loopback_endpoint(endpoint):
        return
    raise ValueError(
        f"refusing to bind KV events to {endpoint!r}: not a loopback address, and the "
        f"events tell anyone who connects what is cached; pass {ALLOW_REMOTE_FLAG} "
        "(allow_remote=True) to publish beyond this machine"
    )


def _bind(ctx: zmq.Context, kind: int, endpoint: str, hwm: int) -> zmq.Socket:
    """A socket of ``kind`` bound to ``endpoint`` (``tcp://127.0.0.1:*`` picks a port)."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.LINGER, 0)
    if endpoint.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
    try:
        sock.bind(endpoint)
    except zmq.ZMQError:
        sock.close(linger=0)
        raise
    return sock


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
        self.epoch = secrets.randbits(64)
        self.topic = f"{topic_prefix}.{self.epoch:016x}"
        self._topic_bytes = self.topic.encode()
        self._max_batch_events = max_batch_events
        self._max_queue_events = max_queue_events
        self._tick_ms = max(1, round(flush_interval_s * 1000))
        self._dp_rank = dp_rank
        self._queue: deque[KVEvent] = deque()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._next_seq = 0
        self.batches_sent = self.events_sent = self.replays_served = self.events_dropped = 0
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
        self._replay: zmq.Socket | None = None
        try:
            self._pub = _bind(ctx, zmq.PUB, endpoint, PUB_HWM)
            if replay_endpoint is not None:
                # One full replay must fit in a client's pipe, or ROUTER drops the tail.
                self._replay = _bind(ctx, zmq.ROUTER, replay_endpoint, buffer + 16)
        except zmq.ZMQError:
            ctx.destroy(linger=0)
            raise
        self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint: str | None = (
            self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay else None
        )

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
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()  # returns once queued frames drained (bounded by the linger)

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- publisher thread --

    def _run(self) -> None:
        """Wait a tick (or a replay request), serve replays, send what is queued; repeat."""
        try:
            while not (self._stop.is_set() and not self._queue):
                backlog = len(self._queue) >= self._max_batch_events
                self._wait(0 if backlog else self._tick_ms)
                self._serve_replays()
                self._send_queued()
        except Exception:
            log.exception("KV events publisher thread failed")

    def _wait(self, timeout_ms: int) -> None:
        """Sleep up to ``timeout_ms``, waking early for a replay request."""
        if self._replay is not None:
            self._replay.poll(timeout_ms)
        elif timeout_ms:
            time.sleep(timeout_ms / 1000)

    def _send_queued(self) -> None:
        """Drain the queue in batches of at most ``max_batch_events``."""
        while self._queue:
            n = min(len(self._queue), self._max_batch_events)
            self._send_batch([self._queue.popleft() for _ in range(n)])

    def _send_batch(self, events: list[KVEvent]) -> None:
        """Encode, number, send and buffer one batch."""
        try:
            payload = encode_batch(time.time(), events, self._dp_rank)
        except (TypeError, ValueError) as exc:  # never log the events: they may hold tokens
            log.error("dropping %d KV events that failed to encode: %s", len(events), exc)
            self.events_dropped += len(events)
            return
        seq = self._next_seq
        self._next_seq += 1
        self._pub.send_multipart([self._topic_bytes, seq.to_bytes(8, "big"), payload])
        self._buffer.append((seq, payload))
        self.batches_sent += 1
        self.events_sent += len(events)

    def _serve_replays(self) -> None:
        """Answer the replay requests waiting now (a few per tick, so publishing goes on)."""
        if self._replay is None:
            return
        for _ in range(MAX_REPLAYS_PER_TICK):
            if not self._replay.poll(0):
                return
            self._serve_replay(self._replay.recv_multipart())

    def _serve_replay(self, frames: list[bytes]) -> None:
        """Send every buffered batch with ``seq >= start``, then the end marker."""
        assert self._replay is not None
        # REQ (and a DEALER speaking like one) sends [id, b"", start]; a bare DEALER [id, start].
        if len(frames) == 3 and frames[1] == b"" and len(frames[2]) == 8:
            envelope = [frames[0], b""]
        elif len(frames) == 2 and len(frames[1]) == 8:
            envelope = [frames[0]]
        else:
            log.warning("ignoring a malformed KV events replay request (%d frames)", len(frames))
            return
        start = int.from_bytes(frames[-1], "big")
        first = self._buffer[0][0] if self._buffer else 0
        for seq, payload in itertools.islice(self._buffer, max(0, start - first), None):
            self._replay.send_multipart(envelope + [seq.to_bytes(8, "big"), payload])
        self.replays_served += 1  # before the marker: a client that saw it sees the count
        self._replay.send_multipart(envelope + [END_SEQ, b""])


def sink_for(publisher: KVEventPublisher, *, include_token_ids: bool) -> EventSink:
    """An ``EventSink`` feeding ``publisher``; token ids (the prompt) are stripped unless asked."""
    if include_token_ids:
        return publisher.publish

    def publish_without_tokens(event: KVEvent) -> None:
        if isinstance(event, BlockStored) and event.token_ids:
            event = dataclasses.replace(event, token_ids=[])
        publisher.publish(event)

    return publish_without_tokens
