"""Helpers for the hostile-peer KV-event tests: a publisher on 127.0.0.1, a DEALER attacker,
and checks that the stream still works (a replay answers, the PUB socket publishes)."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import zmq

from prefixcache.cache.events import BlockStored
from prefixcache.protocol.kv_events import END_SEQ, decode_batch, request_replay
from prefixcache.server.events import KVEventPublisher

LOCAL = "tcp://127.0.0.1:*"
TIMEOUT_S = 5.0


def wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = TIMEOUT_S) -> None:
    """Spin (bounded) until ``predicate`` holds."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def digest(*parts: object) -> bytes:
    return hashlib.sha256(repr(parts).encode()).digest()


@contextmanager
def publishers() -> Iterator[Callable[..., KVEventPublisher]]:
    """A factory of publishers on free loopback ports, all closed on exit."""
    made: list[KVEventPublisher] = []

    def factory(**options: object) -> KVEventPublisher:
        pub = KVEventPublisher(LOCAL, LOCAL, flush_interval_s=0.002, **options)  # type: ignore[arg-type]
        made.append(pub)
        return pub

    try:
        yield factory
    finally:
        for pub in made:
            pub.close()


def dealer(endpoint: str) -> zmq.Socket:
    """A DEALER connected to ``endpoint`` (the attacker, or an honest replay client)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def answers(sock: zmq.Socket, timeout_s: float = 2.0) -> list[list[bytes]] | None:
    """Every message up to and including the end marker; None if none came in time."""
    got: list[list[bytes]] = []
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0 and sock.poll(max(1, round(left * 1000))):
        frames = sock.recv_multipart()
        got.append(frames)
        if len(frames) >= 2 and frames[-2] == END_SEQ and frames[-1] == b"":
            return got
    return None


def publish_block(pub: KVEventPublisher, name: str) -> bytes:
    """Publish one BlockStored; wait until the thread sent it; its digest."""
    block = digest(name)
    sent = pub.events_sent
    pub.publish(BlockStored([block], None))
    wait_for(lambda: pub.events_sent > sent, f"the publisher to send {name}")
    return block


def replay_holds(pub: KVEventPublisher, block: bytes) -> bool:
    """An honest replay from 0 (a fresh DEALER) comes back complete and holds ``block``."""
    sock = dealer(pub.replay_endpoint or "")
    try:
        batches, complete = request_replay(sock, 0, TIMEOUT_S)
    finally:
        sock.close(linger=0)
    stored = {h for _, p in batches for e in decode_batch(p)[1] for h in _hashes(e)}
    return complete and block in stored


def pub_delivers(pub: KVEventPublisher, name: str) -> bool:
    """A fresh SUB receives a block published now (nudging until it has joined)."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    sub.connect(pub.endpoint)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        for attempt in range(10_000):
            block = publish_block(pub, f"{name}-{attempt}")
            while sub.poll(50):
                topic, _, payload = sub.recv_multipart()
                if topic == pub.topic.encode() and block in _hashes(decode_batch(payload)[1][0]):
                    return True
            if time.monotonic() > deadline:
                return False
        return False
    finally:
        sub.close(linger=0)


def _hashes(event: object) -> list[bytes]:
    return list(getattr(event, "block_hashes", []))


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` (from /proc)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")
