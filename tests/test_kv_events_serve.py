"""A real ``prefixcache serve`` (tiny model, 127.0.0.1) under attack on its replay socket.

The issue's case, one 9-byte message (``[b"", b"\\xff" * 8]``) that used to stop KV events
for good, and four 200 MB frames that used to pile up unread: afterwards the server still
publishes the events of a new prompt, answers an honest replay, and its memory stayed put.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

import loopback
from event_fixtures import answers, dealer, rss_bytes
from prefixcache.cache.events import BlockStored
from prefixcache.protocol.kv_events import END_SEQ, decode_batch, request_replay
from router_fixtures import ReplicaProcess, write_tiny_hf_model

BIG_FRAME_BYTES = 200 << 20
RSS_GROWTH_LIMIT = 100 << 20


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReplicaProcess]:
    work: Path = tmp_path_factory.mktemp("events-serve")
    server = ReplicaProcess(write_tiny_hf_model(work / "tiny"), work).start()
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def replay_endpoint(replica: ReplicaProcess) -> str:
    return f"tcp://127.0.0.1:{replica.replay_port}"


def chat(replica: ReplicaProcess, prompt: str) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 1}
    response = loopback.post(f"{replica.url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text


def publishes_new_prompts(replica: ReplicaProcess, name: str, timeout_s: float = 20) -> bool:
    """A fresh SUB sees a BlockStored for a prompt sent now (retried while it joins)."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    sub.connect(f"tcp://127.0.0.1:{replica.events_port}")
    deadline = time.monotonic() + timeout_s
    try:
        for attempt in range(1000):
            chat(replica, f"{name} {attempt}: " + " ".join(f"w{attempt}x{i}" for i in range(40)))
            while sub.poll(300):
                _, _, payload = sub.recv_multipart()
                if any(isinstance(e, BlockStored) for e in decode_batch(payload)[1]):
                    return True
            if time.monotonic() > deadline:
                return False
        return False
    finally:
        sub.close(linger=0)


def events_health(replica: ReplicaProcess) -> dict:
    response = loopback.get(f"{replica.url}/health", timeout=5)
    assert response.status_code == 200
    return response.json()["kv_events"]


def honest_replay_completes(replica: ReplicaProcess) -> bool:
    sock = dealer(replay_endpoint(replica))
    try:
        batches, complete = request_replay(sock, 0, 5.0)
    finally:
        sock.close(linger=0)
    return complete and bool(batches)


def test_the_issue_message_no_longer_stops_kv_events(replica: ReplicaProcess) -> None:
    assert publishes_new_prompts(replica, "before")
    attacker = dealer(replay_endpoint(replica))
    attacker.send_multipart([b"", b"\xff" * 8])
    assert answers(attacker) == [[b"", END_SEQ, b""]]  # vLLM's answer: nothing past the end
    attacker.close(linger=0)
    assert publishes_new_prompts(replica, "after")
    assert honest_replay_completes(replica)
    assert events_health(replica)["status"] == "ok" and events_health(replica)["failures"] == 0


def test_four_200_mb_frames_are_refused_and_memory_stays_put(replica: ReplicaProcess) -> None:
    assert replica.process is not None
    pid = replica.process.pid
    assert publishes_new_prompts(replica, "warm")  # RSS measured once serving is warm
    before = rss_bytes(pid)
    frame = bytes(BIG_FRAME_BYTES)
    for _ in range(4):
        attacker = dealer(replay_endpoint(replica))
        attacker.send_multipart([b"", frame], copy=False)
        assert answers(attacker, timeout_s=2.0) is None  # dropped by libzmq, never read
        attacker.close(linger=0)
    del frame
    peak = rss_bytes(pid)
    time.sleep(1.0)
    assert publishes_new_prompts(replica, "after-big-frames")
    assert honest_replay_completes(replica)
    after = rss_bytes(pid)
    assert max(peak, after) - before < RSS_GROWTH_LIMIT, (before, peak, after)
    assert events_health(replica)["status"] == "ok" and events_health(replica)["failures"] == 0
