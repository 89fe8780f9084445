"""EventFeed over real ZMQ sockets: replay on connect, live updates, epochs, detach."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator

import pytest

from prefixcache.cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from prefixcache.router.feed import EventEndpoints, EventFeed, replay_from
from prefixcache.router.index import GlobalIndex, Overlap
from prefixcache.server.events import KVEventPublisher
from router_fixtures import wait_until

REPLICA = "http://replica"


def chain(name: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{name}/{i}".encode()).digest() for i in range(n)]


@pytest.fixture
def make_publisher() -> Iterator[Callable[..., KVEventPublisher]]:
    made: list[KVEventPublisher] = []

    def make(
        endpoint: str = "tcp://127.0.0.1:*", replay: str = "tcp://127.0.0.1:*", **kw: object
    ) -> KVEventPublisher:
        publisher = KVEventPublisher(endpoint, replay, **kw)  # type: ignore[arg-type]
        made.append(publisher)
        return publisher

    yield make
    for publisher in made:
        publisher.close()


def endpoints(publisher: KVEventPublisher) -> EventEndpoints:
    return EventEndpoints(publisher.endpoint, publisher.replay_endpoint, publisher.topic)


def publish_and_wait(publisher: KVEventPublisher, *events: object) -> None:
    """Publish each event as a batch of its own (the publisher's thread batches every 5 ms)."""
    for event in events:
        target = publisher.events_sent + 1
        publisher.publish(event)  # type: ignore[arg-type]
        wait_until(lambda t=target: publisher.events_sent >= t, 5, "the publisher to send")


def test_feed_replays_what_was_published_before_it_connected(make_publisher) -> None:
    publisher = make_publisher()
    doc = chain("doc", 4)
    publish_and_wait(publisher, BlockStored(doc[:2], None), BlockStored(doc[2:], doc[1]))
    assert [seq for seq, _ in replay_from(publisher.replay_endpoint, 0)] == [0, 1]
    index = GlobalIndex()
    feed = EventFeed(REPLICA, endpoints(publisher), index, None, poll_ms=10).start()
    try:
        assert feed.synced.wait(5)
        assert index.overlap(REPLICA, doc) == Overlap(4, 0)  # no live event was needed
        publish_and_wait(publisher, BlockRemoved(doc[3:]))
        wait_until(lambda: index.overlap(REPLICA, doc) == Overlap(3, 0), what="the removal")
        publish_and_wait(publisher, BlockStored(doc, None, medium="disk"), AllBlocksCleared())
        wait_until(lambda: index.overlap(REPLICA, doc) == Overlap(0, 4), what="the reset")
        # The live subscriber replays from 0 too when it joins; each batch still counts once.
        assert feed.stats.batches == publisher.batches_sent == 5
    finally:
        feed.stop(join_s=2)


def test_a_new_epoch_clears_the_replicas_old_entries(make_publisher) -> None:
    first = make_publisher()
    index = GlobalIndex()
    feed = EventFeed(REPLICA, endpoints(first), index, None, poll_ms=10).start()
    old, new = chain("old", 3), chain("new", 2)
    try:
        assert feed.synced.wait(5)
        publish_and_wait(first, BlockStored(old, None))
        wait_until(lambda: index.overlap(REPLICA, old) == Overlap(3, 0), what="the first epoch")
        ports = (first.endpoint, first.replay_endpoint)
        first.close()
        second = make_publisher(*ports)  # a restarted replica, same ports, new epoch
        # A SUB socket reconnects after a moment: what the new process publishes before
        # that is dropped, and replay of the new epoch from seq 0 brings it back.
        publish_and_wait(second, BlockStored(new, None))
        for i in range(100):
            if index.overlap(REPLICA, new) == Overlap(2, 0):
                break
            publish_and_wait(second, BlockStored(chain("more", i + 1)[i:], None))
        wait_until(lambda: index.overlap(REPLICA, new) == Overlap(2, 0), what="the new epoch")
        assert index.overlap(REPLICA, old) == Overlap(0, 0)
        assert feed.stats.epochs == 1 and feed.topic == second.topic.encode()
    finally:
        feed.stop(join_s=2)


def test_a_restart_on_a_fixed_topic_clears_the_replicas_old_entries(make_publisher) -> None:
    """vLLM-style fixed topic, map form: a restart shows only as seq going back to 0."""
    first = make_publisher(topic="kv@pod-a@tiny", wire_format="map")
    index = GlobalIndex()
    feed = EventFeed(REPLICA, endpoints(first), index, None, poll_ms=10).start()
    old, new = chain("old", 3), chain("new", 2)
    try:
        assert feed.synced.wait(5)
        publish_and_wait(first, BlockStored(old, None))
        wait_until(lambda: index.overlap(REPLICA, old) == Overlap(3, 0), what="the first run")
        for i in range(60):  # far ahead, so the restarted run's numbers go back
            publish_and_wait(first, BlockRemoved(chain("gone", i + 1)[i:]))
        wait_until(lambda: feed.stats.batches == 61, what="the first run's batches")
        ports = (first.endpoint, first.replay_endpoint)
        first.close()
        second = make_publisher(*ports, topic="kv@pod-a@tiny", wire_format="map")
        publish_and_wait(second, BlockStored(new, None))
        for i in range(50):
            if index.overlap(REPLICA, new) == Overlap(2, 0):
                break
            publish_and_wait(second, BlockStored(chain("more", i + 1)[i:], None))
        wait_until(lambda: index.overlap(REPLICA, new) == Overlap(2, 0), what="the restart")
        assert index.overlap(REPLICA, old) == Overlap(0, 0)
        assert feed.stats.epochs == 1 and feed.topic == b"kv@pod-a@tiny"
    finally:
        feed.stop(join_s=2)


def test_a_stopped_and_detached_feed_changes_nothing(make_publisher) -> None:
    publisher = make_publisher()
    index = GlobalIndex()
    feed = EventFeed(REPLICA, endpoints(publisher), index, None, poll_ms=10).start()
    assert feed.synced.wait(5)
    feed.stop(join_s=2)
    index.detach(REPLICA)
    publish_and_wait(publisher, BlockStored(chain("late", 2), None))
    assert index.overlap(REPLICA, chain("late", 2)) == Overlap(0, 0)
    assert index.replicas() == []


WINDOW_KIND = {"kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 8}


@pytest.mark.parametrize("wire_format", ["array", "map"])
def test_a_feed_scores_on_full_groups_and_skips_window_groups(make_publisher, wire_format) -> None:
    publisher = make_publisher(wire_format=wire_format)
    index = GlobalIndex()
    feed = EventFeed(REPLICA, endpoints(publisher), index, None, poll_ms=10).start()
    doc, windowed, second = chain("doc", 4), chain("windowed", 2), chain("second", 2)
    try:
        assert feed.synced.wait(5)
        publish_and_wait(
            publisher,
            BlockStored(doc, None),
            BlockStored(doc, None, group_idx=1, **WINDOW_KIND),
            BlockStored(windowed, None, group_idx=1, **WINDOW_KIND),  # a window group only
            BlockRemoved(doc[:2], group_idx=1),  # tombstones: the full layers keep them
            BlockRemoved(doc[2:], group_idx=3),  # a group never announced: not a full one
            BlockStored(second, None, group_idx=2),  # a second full group (vLLM may have one)
        )
        wait_until(lambda: feed.stats.events == 6, what="the events")
        assert index.overlap(REPLICA, doc) == Overlap(4, 0)
        assert index.overlap(REPLICA, windowed) == Overlap(0, 0)
        assert index.overlap(REPLICA, second) == Overlap(2, 0)
        publish_and_wait(publisher, BlockRemoved(second[1:], group_idx=2), BlockRemoved(doc[3:]))
        wait_until(lambda: feed.stats.events == 8, what="the full groups' removals")
        assert index.overlap(REPLICA, second) == Overlap(1, 0)
        assert index.overlap(REPLICA, doc) == Overlap(3, 0)
    finally:
        feed.stop(join_s=2)


def test_a_hybrid_replicas_events_leave_the_index_with_its_full_layers(make_publisher) -> None:
    """A real hybrid pool's events (window pages evicted, blocks evicted) through a feed."""
    from prefixcache import KVCacheManager
    from prefixcache.cache.groups import KVGroupSpec

    publisher = make_publisher()
    index = GlobalIndex()
    feed = EventFeed(REPLICA, endpoints(publisher), index, None, poll_ms=10).start()
    m = KVCacheManager(16, 4, groups=[KVGroupSpec(1), KVGroupSpec(1, 8)])
    published: list[object] = []
    m.set_event_sink(lambda event: (published.append(event), publisher.publish(event)))
    try:
        assert feed.synced.wait(5)
        for i, tokens in enumerate([list(range(25)), list(range(100, 113)), [7] * 9]):
            seq = m.admit(f"r{i}", tokens)
            m.commit(seq, len(tokens))
            m.free(seq)
        assert m.stats.window_pages_evicted and m.stats.evictions  # both kinds of removal
        wait_until(lambda: feed.stats.events == len(published), what="every event")
        assert any(getattr(event, "group_idx", 0) for event in published)
        indexed = [block.digest for block in m.pool.cached.values()]
        assert index.counts(REPLICA).pool == len(indexed)
        assert all(index.holders(digest) == {REPLICA} for digest in indexed)
    finally:
        feed.stop(join_s=2)
