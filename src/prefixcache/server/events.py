"""KV events on the wire: vLLM's ZMQ format, a PUB stream plus a ROUTER replay socket.

Each batch is one PUB message of three frames, ``[topic, seq, payload]``: ``seq`` is an
8-byte big-endian counter from 0, ``payload`` the msgpack array ``[ts, events, dp_rank]``
with each event an array tagged by its class name, field order as in vLLM::

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
     medium, lora_name]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]

vLLM encodes these with msgspec ``array_like=True`` structs, where ``omit_defaults`` has no
effect: every field is written, ``None`` as nil, and a decoder ignores extra trailing
elements. A replay client sends ``[b"", start]`` (8 bytes, big-endian) to the ROUTER and
gets every buffered batch with ``seq >= start`` as ``[b"", seq, payload]``, then the end
marker ``[b"", -1 (signed), b""]``. Topics are ``f"{prefix}.{epoch:016x}"``, a random
epoch per boot, so a consumer can tell a restarted replica from a gap.
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
from collections.abc import Sequence
from typing import Any

import msgpack
import zmq

from prefixcache.cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventSink,
    KVEvent,
)

log = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"
ALLOW_REMOTE_FLAG = "--kv-events-allow-remote"
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # vLLM's end-of-replay marker
PUB_HWM = 100_000  # messages queued per subscriber before ZMQ drops (vLLM's default)
CLOSE_LINGER_MS = 200  # how long close() lets queued frames drain to subscribers
MAX_REPLAYS_PER_TICK = 8  # replay requests served between two flushes of the queue

# Field names in wire order, after the tag (vLLM's struct declaration order).
WIRE_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}
_RECORDS: dict[str, type[KVEvent]] = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}


# --- codec -------------------------------------------------------------------------


def _event_to_wire(event: KVEvent) -> list[Any]:
    """One event as vLLM's tagged array (``lora_name`` is always nil here)."""
    if isinstance(event, BlockStored):
        return [
            "BlockStored",
            list(event.block_hashes),
            event.parent_block_hash,
            list(event.token_ids),
            event.block_size,
            event.lora_id,
            event.medium,
            None,
        ]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", list(event.block_hashes), event.medium]
    if isinstance(event, AllBlocksCleared):
        return ["AllBlocksCleared"]
    raise TypeError(f"not a KV event: {type(event).__name__}")


def encode_batch(ts: float, events: Sequence[KVEvent], dp_rank: int | None = None) -> bytes:
    """The msgpack payload of one batch: ``[ts, [tagged events...], dp_rank]``."""
    body = [float(ts), [_event_to_wire(e) for e in events], dp_rank]
    return msgpack.packb(body, use_bin_type=True)


def _event_from_wire(item: Any) -> KVEvent | None:
    """A tagged array (or a newer vLLM's tagged map) as a record; None for unknown tags."""
    if isinstance(item, dict):
        tag = item.get("type")
        values = {k: item[k] for k in WIRE_FIELDS.get(tag, ()) if k in item}
    else:
        tag = item[0] if item else None
        values = dict(zip(WIRE_FIELDS.get(tag, ()), item[1:], strict=False))
    record = _RECORDS.get(tag) if isinstance(tag, str) else None
    if record is None:
        return None  # an event kind we do not track (vLLM has transfer events too)
    values.pop("lora_name", None)  # not in our records; the LoRA is in the digest
    return record(**values)


def decode_batch(payload: bytes) -> tuple[float, list[KVEvent]]:
    """Inverse of ``encode_batch``; also reads a batch or events encoded as maps."""
    batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    if isinstance(batch, dict):
        ts, items = batch["ts"], batch["events"]
    else:
        ts, items = batch[0], batch[1]
    events = [e for e in map(_event_from_wire, items) if e is not None]
    return float(ts), events


# --- endpoints ---------------------------------------------------------------------


def request_replay(
    dealer: zmq.Socket, start: int, timeout_s: float
) -> tuple[list[tuple[int, bytes]], bool]:
    """Ask a replay socket (through ``dealer``) for every batch with ``seq >= start``.

    Returns the ``(seq, payload)`` batches that arrived, in order, and whether the end
    marker came before ``timeout_s`` (the client side of ``_serve_replay``, vLLM's exchange).
    """
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    got: list[tuple[int, bytes]] = []
    deadline = time.monotonic() + timeout_s
    while (remaining := deadline - time.monotonic()) > 0:
        if not dealer.poll(max(1, round(remaining * 1000))):
            break
        frames = dealer.recv_multipart()
        if len(frames) < 2:
            continue
        if frames[-2] == END_SEQ:
            return got, True
        got.append((int.from_bytes(frames[-2], "big", signed=True), frames[-1]))
    return got, False


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
