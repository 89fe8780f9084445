"""The publisher's loop never dies: a failing step is counted, logged and restarted (issue 21).

Each test makes one internal step of a real publisher (on 127.0.0.1) raise, once or always,
then checks the count, the status ``/health`` would report, and that events still flow.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import pytest
import zmq
from prometheus_client import CollectorRegistry, generate_latest

from event_fixtures import (
    TIMEOUT_S,
    pub_delivers,
    publish_block,
    publishers,
    replay_holds,
    wait_for,
)
from prefixcache.cache.events import BlockStored
from prefixcache.protocol.event_subscriber import EpochChange, KVEventSubscriber
from prefixcache.server.event_health import MAX_FAILURES_IN_A_ROW
from prefixcache.server.events import KVEventPublisher

Factory = Callable[..., KVEventPublisher]


@pytest.fixture
def make_publisher() -> Iterator[Factory]:
    with publishers() as factory:
        yield factory


def fail_once(target: Callable, error: Exception) -> Callable:
    """``target``, except that its first call raises ``error``."""
    calls = []

    def flaky(*args: object) -> object:
        calls.append(1)
        if len(calls) == 1:
            raise error
        return target(*args)

    return flaky


def metrics_text(pub: KVEventPublisher) -> str:
    registry = CollectorRegistry()
    registry.register(pub.collector())
    return generate_latest(registry).decode()


@pytest.mark.parametrize("error", [RuntimeError("boom"), zmq.ZMQError(zmq.ENOTSOCK)])
def test_a_publish_that_fails_once_is_retried_and_nothing_is_lost(
    make_publisher: Factory, monkeypatch: pytest.MonkeyPatch, error: Exception
) -> None:
    pub = make_publisher()
    first = publish_block(pub, "first")
    topic = pub.topic
    monkeypatch.setattr(pub, "_send_batch", fail_once(pub._send_batch, error))
    second = publish_block(pub, "second")  # the failed batch goes out after the restart
    assert pub.health_state.failures == {"publish": 1} and pub.up
    assert pub.health()["status"] == "ok" and pub.health()["failures"] == 1
    assert (pub.topic, pub.events_dropped, pub.batches_sent) == (topic, 0, 2)  # same epoch
    assert replay_holds(pub, first) and replay_holds(pub, second)
    assert pub_delivers(pub, "after")  # sockets rebound after the ZMQError: still live
    assert 'prefixcache_kv_events_failures_total{kind="publish"} 1.0' in metrics_text(pub)


def test_a_replay_step_that_fails_once_is_counted_and_replays_go_on(
    make_publisher: Factory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pub = make_publisher()
    block = publish_block(pub, "block")
    replays = pub._replays
    assert replays is not None
    monkeypatch.setattr(replays, "serve_waiting", fail_once(replays.serve_waiting, KeyError()))
    with caplog.at_level(logging.ERROR, logger="prefixcache.server.events"):
        assert replay_holds(pub, block)  # the request waits out the restart, then is served
    assert pub.health_state.failures == {"replay": 1} and pub.up
    (line,) = [r.getMessage() for r in caplog.records]
    assert "replay step failed (KeyError), 1 in a row; restarting its loop" in line


def test_a_loop_that_always_fails_marks_events_down_then_recovers(
    make_publisher: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    pub = make_publisher(max_queue_events=4)
    publish_block(pub, "before")
    topic = pub.topic
    monkeypatch.setattr(pub, "_wait", lambda timeout_ms: 1 / 0)
    wait_for(lambda: not pub.up, "events to be marked down")
    assert pub.health()["status"] == "down"
    assert pub.health_state.failures["poll"] >= MAX_FAILURES_IN_A_ROW
    assert "prefixcache_kv_events_up 0.0" in metrics_text(pub)
    for i in range(6):  # the queue holds 4: two are dropped while down
        pub.publish(BlockStored([bytes([i]) * 32], None))
    monkeypatch.undo()
    wait_for(lambda: pub.up, "events to be up again", TIMEOUT_S)
    wait_for(lambda: pub.events_sent == 5, "the queued events to go out")
    assert pub.events_dropped == 2 and pub.topic != topic and pub.epochs == 2  # a new epoch
    assert pub_delivers(pub, "after")


def test_an_event_that_cannot_be_encoded_starts_a_new_epoch(make_publisher: Factory) -> None:
    pub = make_publisher()
    with KVEventSubscriber(pub.endpoint, pub.replay_endpoint, b"kv-events") as sub:
        wait_for(lambda: publish_block(pub, "nudge") and bool(sub.poll(20)), "the SUB to join")
        old_topic = pub.topic
        pub.publish(BlockStored([object()], None))  # type: ignore[list-item]  # msgpack refuses
        wait_for(lambda: pub.events_dropped == 1, "the bad event to be dropped")
        publish_block(pub, "next")
        assert pub.topic != old_topic and pub.epochs == 2
        new_topic, got = pub.topic.encode(), []
        wait_for(lambda: any(t == new_topic for t, _, _ in got.extend(sub.poll(20)) or got), "it")
        assert any(isinstance(n, EpochChange) for n in sub.take_notices())
    assert pub.health_state.failures == {} and pub.up  # a drop, not a failure of the loop
