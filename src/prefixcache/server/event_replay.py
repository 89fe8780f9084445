"""The replay side of the KV-event publisher: requests on a ROUTER socket, answered from its
buffer. Runs on the publisher's thread only.

Every request is checked (``parse_replay_request``): one that is malformed, or asks for a
batch past the last one, gets the end marker alone (vLLM's answer to a start past the end)
and is counted by problem. Surplus frames of a request are discarded a few thousand per
tick, so a request of millions of frames cannot hold up publishing.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence

import zmq

from prefixcache.protocol.kv_events import END_SEQ, ReplayRequest, parse_replay_request
from prefixcache.server.event_health import EventsHealth

log = logging.getLogger("prefixcache.server.events")

MAX_REPLAYS_PER_TICK = 8  # replay requests served between two flushes of the queue
MAX_SKIPPED_FRAMES = 4096  # surplus frames of one request discarded per tick
MAX_KEPT_FRAMES = 4  # frames of a request read before the rest is skipped (3 is valid)


class ReplayServer:
    """Serves replay requests from ``buffer`` (``(seq, payload)`` in order) on ``sock``."""

    def __init__(self, sock: zmq.Socket, health: EventsHealth) -> None:
        self.sock = sock
        self.health = health
        self.served = 0  # requests answered with batches (and the marker)
        self._skipping = False  # inside a request with more than MAX_KEPT_FRAMES frames

    def rebind(self, sock: zmq.Socket) -> None:
        """Serve on a new socket (the old one broke)."""
        self.sock, self._skipping = sock, False

    def serve_waiting(self, buffer: Sequence[tuple[int, bytes]], next_seq: int) -> None:
        """Answer the requests waiting now (a few per tick, so publishing goes on)."""
        for _ in range(MAX_REPLAYS_PER_TICK):
            if not self._skip_rest() or not self.sock.poll(0):
                return
            self._serve(self._recv_request(), buffer, next_seq)

    def _recv_request(self) -> list[bytes]:
        """One request's frames, at most ``MAX_KEPT_FRAMES`` (the rest is skipped)."""
        frames = [self.sock.recv()]
        while len(frames) < MAX_KEPT_FRAMES and self.sock.getsockopt(zmq.RCVMORE):
            frames.append(self.sock.recv())
        self._skipping = bool(self.sock.getsockopt(zmq.RCVMORE))
        return frames

    def _skip_rest(self) -> bool:
        """Discard up to ``MAX_SKIPPED_FRAMES`` of a request's surplus; True once past it."""
        for _ in range(MAX_SKIPPED_FRAMES):
            if not self._skipping:
                return True
            self.sock.recv(copy=False)
            self._skipping = bool(self.sock.getsockopt(zmq.RCVMORE))
        return not self._skipping

    def _serve(
        self, frames: list[bytes], buffer: Sequence[tuple[int, bytes]], next_seq: int
    ) -> None:
        """Send every buffered batch with ``seq >= start``, then the end marker."""
        request = parse_replay_request(frames)
        if request.problem is None and request.start > next_seq:
            request = request._replace(problem="start_ahead")
        if request.problem is not None:
            self._refuse(request)
            return
        first = buffer[0][0] if buffer else next_seq
        skip = max(0, request.start - first)  # at most len(buffer), as start <= next_seq
        for seq, payload in itertools.islice(buffer, skip, None):
            self.sock.send_multipart(request.envelope + [seq.to_bytes(8, "big"), payload])
        self.served += 1  # before the marker: a client that saw it sees the count
        self.sock.send_multipart(request.envelope + [END_SEQ, b""])

    def _refuse(self, request: ReplayRequest) -> None:
        """The end marker alone, counted (and logged at the 1st, 2nd, 4th, 8th... of a kind)."""
        assert request.problem is not None
        count = self.health.reject(request.problem)
        if count & (count - 1) == 0:  # a flood of requests cannot flood the log
            log.warning(
                "KV events: replay request refused (%s), answered with the end marker; %d so far",
                request.problem,
                count,
            )
        self.sock.send_multipart(request.envelope + [END_SEQ, b""])
