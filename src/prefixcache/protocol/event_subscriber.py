"""Read one replica's KV events in order: gaps filled through replay, restarts reported.

Speaks only the wire format (``[topic, seq, payload]`` on PUB, the replay exchange on the
ROUTER; see ``prefixcache.protocol.kv_events``), so it reads vLLM's publisher as well as ours.
Replay goes through a DEALER: a REQ socket, as in vLLM's example, can take only the first
of the many replies a replay sends.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import zmq

from prefixcache.cache.events import KVEvent
from prefixcache.protocol.kv_events import decode_batch, request_replay

log = logging.getLogger(__name__)

Received = tuple[bytes, int, list[KVEvent]]  # (topic, seq, events)


@dataclass(frozen=True, slots=True)
class EpochChange:
    """The publisher of ``stream`` restarted: its state is gone, ``new_topic`` starts at 0."""

    stream: bytes
    old_topic: bytes
    new_topic: bytes


@dataclass(frozen=True, slots=True)
class BatchesLost:
    """Batches ``first..last`` of ``topic`` were missed and replay could not return them."""

    topic: bytes
    first: int
    last: int


Notice = EpochChange | BatchesLost


def stream_of(topic: bytes) -> bytes:
    """The topic without its epoch suffix (``kv-events.<16 hex>`` -> ``kv-events``)."""
    prefix, dot, suffix = topic.rpartition(b".")
    if dot and len(suffix) == 16 and all(c in b"0123456789abcdef" for c in suffix):
        return prefix
    return topic


class KVEventSubscriber:
    """SUB socket plus replay client; single-threaded (call it from one thread).

    ``poll`` returns batches in sequence order without gaps. A gap (or, with ``catch_up``,
    joining mid-stream) is filled from the replay socket; what replay cannot return is
    reported as ``BatchesLost``. An epoch change ends a poll: results never mix epochs,
    and ``take_notices()`` after a poll says what happened before the next one.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: bytes | str = b"",
        *,
        catch_up: bool = True,
        replay_timeout_ms: int = 1000,
    ) -> None:
        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode() if isinstance(topic, str) else topic)
        self._sub.connect(endpoint)
        self._replay_endpoint = replay_endpoint
        self._dealer: zmq.Socket | None = None
        self._catch_up = catch_up
        self._replay_timeout_s = replay_timeout_ms / 1000
        self._last_seq: dict[bytes, int] = {}  # topic -> last seq delivered
        self._topic_of: dict[bytes, bytes] = {}  # stream -> current topic (epoch)
        self._pending: list[bytes] | None = None  # first message of a new epoch
        self._notices: list[Notice] = []
        self.batches_received = self.batches_replayed = self.batches_lost = 0
        self.replays_requested = self.malformed = 0

    # -- public API --

    def poll(self, timeout_ms: int, max_batches: int = 10_000) -> list[Received]:
        """Wait up to ``timeout_ms`` for a batch, then take whatever else is ready."""
        deadline = time.monotonic() + timeout_ms / 1000
        out: list[Received] = []
        while len(out) < max_batches:
            wait_ms = 0 if out else max(0, round((deadline - time.monotonic()) * 1000))
            frames = self._next_frames(wait_ms)
            if frames is None or not self._accept(frames, out):
                break
        return out

    def take_notices(self) -> list[Notice]:
        """Epoch changes and unrecoverable losses seen since the last call, in order."""
        notices, self._notices = self._notices, []
        return notices

    def last_seq(self, topic: bytes) -> int:
        """The last sequence number delivered for ``topic`` (-1 if none)."""
        return self._last_seq.get(topic, -1)

    def close(self) -> None:
        """Close both sockets without waiting."""
        self._sub.close(linger=0)
        self._reset_dealer()

    def __enter__(self) -> KVEventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- live stream --

    def _next_frames(self, timeout_ms: int) -> list[bytes] | None:
        """The held-back message, else the next one from SUB within ``timeout_ms``."""
        if self._pending is not None:
            frames, self._pending = self._pending, None
            return frames
        if not self._sub.poll(timeout_ms):
            return None
        return self._sub.recv_multipart()

    def _accept(self, frames: list[bytes], out: list[Received]) -> bool:
        """Deliver one live message (after any replayed batches); False ends the poll."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self.malformed += 1
            return True
        topic, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big")
        if self._is_new_epoch(topic, seq):
            self._pending = frames
            return False
        last = self._last_seq.get(topic)
        if last is None and not self._catch_up and topic not in self._topic_of.values():
            last = seq - 1  # join live: what came before this is not ours to replay
        first_missing = 0 if last is None else last + 1
        if seq > first_missing:
            self._fill(topic, first_missing, seq - 1, out)
        self._topic_of[stream_of(topic)] = topic
        return self._deliver(topic, seq, payload, out)

    def _is_new_epoch(self, topic: bytes, seq: int) -> bool:
        """Record an epoch change (a new topic suffix, or seq going back on one topic)."""
        stream = stream_of(topic)
        known = self._topic_of.get(stream)
        restarted = known == topic and seq <= self._last_seq.get(topic, -1)
        if known is None or (known == topic and not restarted):
            return False
        log.info("KV events stream %r restarted (new epoch)", stream)
        self._notices.append(EpochChange(stream, known, topic))
        self._topic_of[stream] = topic
        self._last_seq.pop(topic, None)  # the new epoch is replayed from 0
        return True

    def _deliver(self, topic: bytes, seq: int, payload: bytes, out: list[Received]) -> bool:
        """Decode one batch into ``out`` and advance the topic's sequence."""
        try:
            _, events = decode_batch(payload)
        except Exception:  # a batch we cannot read is a lost batch, not a crash
            self.malformed += 1
            self._lose(topic, seq, seq)
            events = None
        if events is not None:
            out.append((topic, seq, events))
            self.batches_received += 1
        self._last_seq[topic] = seq
        return True

    def _lose(self, topic: bytes, first: int, last: int) -> None:
        """Report batches that are gone for good."""
        log.warning("KV events %r: lost batches %d..%d", topic, first, last)
        self.batches_lost += last - first + 1
        self._notices.append(BatchesLost(topic, first, last))

    # -- replay --

    def _fill(self, topic: bytes, first: int, last: int, out: list[Received]) -> None:
        """Deliver batches ``first..last`` from replay; report the ones it lacks."""
        got = self._replay_range(first, last)
        lost_from: int | None = None
        for seq in range(first, last + 1):
            payload = got.get(seq)
            if payload is None:
                lost_from = seq if lost_from is None else lost_from
                continue
            if lost_from is not None:
                self._lose(topic, lost_from, seq - 1)
                lost_from = None
            self.batches_replayed += 1
            self._deliver(topic, seq, payload, out)
        if lost_from is not None:
            self._lose(topic, lost_from, last)
        self._last_seq[topic] = last

    def _replay_range(self, first: int, last: int) -> dict[int, bytes]:
        """Ask the replay socket for ``seq >= first``; keep ``first..last`` (bounded wait)."""
        if self._replay_endpoint is None:
            return {}
        self.replays_requested += 1
        batches, complete = request_replay(self._dealer_socket(), first, self._replay_timeout_s)
        got = {seq: payload for seq, payload in batches if first <= seq <= last}
        if complete:
            return got
        log.warning("KV events replay timed out after %.1fs", self._replay_timeout_s)
        self._reset_dealer()  # late replies must not leak into the next replay
        return got

    def _dealer_socket(self) -> zmq.Socket:
        """The replay DEALER, connected on first use."""
        if self._dealer is None:
            assert self._replay_endpoint is not None
            self._dealer = self._ctx.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            self._dealer.connect(self._replay_endpoint)
        return self._dealer

    def _reset_dealer(self) -> None:
        """Drop the DEALER (and anything still in flight to it)."""
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None
