"""KV events over real ZMQ sockets on 127.0.0.1: vLLM's wire format, replay, epochs, safety."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Iterator

import msgpack
import pytest
import zmq

from prefixcache.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from prefixcache.protocol.event_subscriber import EpochChange, KVEventSubscriber, Received
from prefixcache.protocol.kv_events import decode_batch, encode_batch
from prefixcache.server.events import ALLOW_REMOTE_FLAG, KVEventPublisher, sink_for

LOCAL = "tcp://127.0.0.1:*"  # bind any free port; the publisher exposes the one it got
TIMEOUT_S = 5.0


def digest(*parts: object) -> bytes:
    """A 32-byte SHA-256 digest, like the cache's portable block hashes."""
    return hashlib.sha256(repr(parts).encode()).digest()


def wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = TIMEOUT_S) -> None:
    """Spin (bounded) until ``predicate`` holds."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


class Feed:
    """Publishes (through a sink, if given) and remembers what it published, in order."""

    def __init__(self, pub: KVEventPublisher, sink: Callable[[KVEvent], None] | None = None):
        self.pub = pub
        self.sink = sink or pub.publish
        self.events: list[KVEvent] = []
        self.pending: list[KVEvent] = []  # what a test publishes once a subscriber is live

    def batch(self, *events: KVEvent) -> None:
        """Publish and wait until the thread has sent them (so batches really split)."""
        for event in events:
            self.sink(event)
            self.events.append(event)
        self.flushed()

    def flushed(self) -> None:
        wait_for(lambda: self.pub.events_sent == len(self.events), "the publisher to flush")

    def all_sent(self, last_seq: int) -> bool:
        """True once ``last_seq`` is the publisher's last batch and nothing is queued."""
        sent = self.pub.events_sent == len(self.events)
        return sent and last_seq == self.pub.batches_sent - 1


def receive_all(sub: KVEventSubscriber, feed: Feed) -> list[Received]:
    """Poll until ``sub`` holds every batch sent; publish fillers while its SUB is joining."""
    feed.flushed()
    got: list[Received] = []
    next_filler = time.monotonic()
    deadline = time.monotonic() + TIMEOUT_S
    while not (got and feed.all_sent(got[-1][1])):
        assert time.monotonic() < deadline, f"stuck at {got[-1][1] if got else None}"
        got += sub.poll(20)
        if not got and time.monotonic() >= next_filler:  # nothing live yet: nudge it
            feed.batch(AllBlocksCleared())
            next_filler = time.monotonic() + 0.05
    return got


def flat(received: list[Received]) -> list[KVEvent]:
    return [event for _, _, events in received for event in events]


@pytest.fixture
def make_publisher() -> Iterator[Callable[..., KVEventPublisher]]:
    made: list[KVEventPublisher] = []

    def factory(endpoint: str = LOCAL, replay: str | None = LOCAL, **kw: object):
        pub = KVEventPublisher(endpoint, replay, flush_interval_s=0.002, **kw)  # type: ignore[arg-type]
        made.append(pub)
        return pub

    yield factory
    for pub in made:
        pub.close()


@pytest.fixture
def make_subscriber() -> Iterator[Callable[..., KVEventSubscriber]]:
    made: list[KVEventSubscriber] = []

    def factory(pub: KVEventPublisher, **kw: object) -> KVEventSubscriber:
        sub = KVEventSubscriber(pub.endpoint, pub.replay_endpoint, b"kv-events", **kw)  # type: ignore[arg-type]
        made.append(sub)
        return sub

    yield factory
    for sub in made:
        sub.close()


# --- (1) vLLM's wire format, read by a subscriber that knows only pyzmq and msgpack ----


def expected_wire(event: KVEvent) -> list[object]:
    """vLLM's tagged-array layout, written out independently of the encoder."""
    if isinstance(event, BlockStored):
        return [
            "BlockStored",
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            event.lora_id,
            event.medium,
            None,  # lora_name
            None,  # extra_keys (newer vLLM)
            event.group_idx,  # newer vLLM: the KV cache group (0: the full layers)
            event.kv_cache_spec_kind,  # ... its kind
            event.kv_cache_spec_sliding_window,  # ... and a window group's window
            event.kv_cache_dtype,  # ours, after vLLM's fields
        ]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", event.block_hashes, event.medium, event.group_idx]
    return ["AllBlocksCleared"]


def raw_replay(ctx: zmq.Context, endpoint: str, start: int) -> dict[int, bytes]:
    """vLLM's replay exchange by hand: 8-byte start, replies until seq -1 / empty payload."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    out: dict[int, bytes] = {}
    try:
        while dealer.poll(2000):
            empty, seq_bytes, payload = dealer.recv_multipart()
            assert empty == b""
            if not payload:
                assert int.from_bytes(seq_bytes, "big", signed=True) == -1
                return out
            out[int.from_bytes(seq_bytes, "big")] = payload
        raise AssertionError("replay never sent its end marker")
    finally:
        dealer.close(linger=0)


def raw_live(sub: zmq.Socket, feed: Feed, topic: bytes) -> dict[int, bytes]:
    """A vLLM-style SUB loop over frames [topic, seq, payload]; seq must go up by one."""
    frames: dict[int, bytes] = {}
    deadline = time.monotonic() + TIMEOUT_S
    while not (frames and feed.all_sent(max(frames))):
        assert time.monotonic() < deadline, "live stream stalled"
        if not frames:
            feed.batch(AllBlocksCleared())  # slow joiner: nudge until a frame is live
        if sub.poll(50):
            got_topic, seq_bytes, payload = sub.recv_multipart()
            assert got_topic == topic and len(seq_bytes) == 8
            seq = int.from_bytes(seq_bytes, "big")
            assert not frames or seq == max(frames) + 1, "live stream skipped a number"
            frames[seq] = payload
            if len(frames) == 1:  # live now: publish what the test is about
                feed.batch(*feed.pending)
    return frames


def test_wire_format_matches_vllm(make_publisher: Callable[..., KVEventPublisher]) -> None:
    pub = make_publisher()
    feed = Feed(pub)
    d = [digest("block", i) for i in range(4)]
    feed.batch(BlockStored([d[0]], None))  # before anyone listens: only replay has it
    feed.pending = [
        BlockStored([d[1], d[2]], d[0], list(range(32)), 16, None, "cpu"),
        BlockStored([d[3]], d[2], lora_id=7),
        BlockStored(
            [d[3]],
            d[2],
            group_idx=2,
            kv_cache_spec_kind="sliding_window",
            kv_cache_spec_sliding_window=512,
        ),
        BlockRemoved([d[1], d[0]]),
        BlockRemoved([d[3]], group_idx=2),
        AllBlocksCleared(),
    ]
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")  # vLLM's example subscribes by prefix
    sub.connect(pub.endpoint)
    try:
        live = raw_live(sub, feed, pub.topic.encode())
    finally:
        sub.close(linger=0)
    replayed = raw_replay(ctx, pub.replay_endpoint, 0)
    assert sorted(replayed) == list(range(pub.batches_sent))
    assert all(replayed[seq] == payload for seq, payload in live.items())  # same bytes
    wire: list[object] = []
    for seq in sorted(replayed):
        batch = msgpack.unpackb(replayed[seq], raw=False)
        assert isinstance(batch, list) and len(batch) == 3  # [ts, events, dp_rank]
        assert isinstance(batch[0], float) and batch[2] is None
        wire += batch[1]
    assert wire == [expected_wire(e) for e in feed.events]
    hashes = [h for item in wire if item[0] != "AllBlocksCleared" for h in item[1]]
    assert all(isinstance(h, bytes) and len(h) == 32 for h in hashes)
    assert set(hashes) == set(d)
    assert pub.replays_served == 1


def test_codec_round_trip_and_newer_vllm_map_form() -> None:
    d = digest("x")
    events = [BlockStored([d], None, [1, 2], 16, 3, "cpu"), BlockRemoved([d]), AllBlocksCleared()]
    assert decode_batch(encode_batch(1.25, events, dp_rank=2)) == (1.25, events)
    # vLLM after PR #42892 sends events as tagged maps with more fields; we read those too.
    newer = msgpack.packb(
        [2.0, [{"type": "BlockStored", "block_hashes": [d], "parent_block_hash": None,
                "token_ids": [], "block_size": 16, "lora_id": None, "medium": "GPU",
                "lora_name": None, "extra_keys": [None], "group_idx": 0},
               {"type": "BlockRemoved", "block_hashes": [d], "medium": "GPU"},
               {"type": "TransferInitiated"}], 0]
    )  # fmt: skip
    ts, decoded = decode_batch(newer)
    assert ts == 2.0
    assert decoded == [BlockStored([d], None, [], 16, None, "GPU"), BlockRemoved([d], "GPU")]


def test_vllm_msgspec_structs_decode_our_payload() -> None:
    """vLLM's own struct definitions (msgspec, array_like) read our bytes."""
    import msgspec

    class Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
        pass

    class Stored(Event, tag="BlockStored"):
        block_hashes: list[bytes | int]
        parent_block_hash: bytes | int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None

    class Removed(Event, tag="BlockRemoved"):
        block_hashes: list[bytes | int]
        medium: str | None
        group_idx: int | None = None

    class Cleared(Event, tag="AllBlocksCleared"):
        pass

    fields = [("ts", float), ("events", list[Stored | Removed | Cleared])]
    fields.append(("data_parallel_rank", int | None, None))  # type: ignore[arg-type]
    # defstruct: string annotations could not name these local classes
    batch_type = msgspec.defstruct("Batch", fields, array_like=True, omit_defaults=True)

    d = digest("y")
    window = BlockStored([d], None, group_idx=1, kv_cache_spec_kind="sliding_window",
                         kv_cache_spec_sliding_window=64, kv_cache_dtype="int8")  # fmt: skip
    events = [BlockStored([d], None), window, BlockRemoved([d], group_idx=1), AllBlocksCleared()]
    batch = msgspec.msgpack.Decoder(batch_type).decode(encode_batch(1.0, events))
    assert [type(e).__name__ for e in batch.events] == ["Stored", "Stored", "Removed", "Cleared"]
    assert batch.events[0].block_hashes == [d]
    stored = batch.events[:2]
    read = [(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in stored]
    assert read == [(0, "full_attention", None), (1, "sliding_window", 64)]  # then our dtype
    assert batch.events[2].group_idx == 1


# --- (2) token ids stay home unless enabled --------------------------------------------


@pytest.mark.parametrize("include", [False, True])
def test_token_ids_only_when_enabled(
    include: bool,
    make_publisher: Callable[..., KVEventPublisher],
    make_subscriber: Callable[..., KVEventSubscriber],
) -> None:
    pub = make_publisher()
    sub = make_subscriber(pub)
    feed = Feed(pub, sink_for(pub, include_token_ids=include))
    tokens = [101, 102, 103, 104]
    feed.batch(BlockStored([digest("t", 0)], None, tokens), BlockRemoved([digest("t", 0)]))
    stored = [e for e in flat(receive_all(sub, feed)) if isinstance(e, BlockStored)]
    assert [e.token_ids for e in stored] == [tokens if include else []]
    assert stored[0].block_hashes == [digest("t", 0)]


# --- (3) late joiners and missed batches catch up through replay -----------------------


class LossyRelay:
    """A test-owned SUB->PUB hop that loses the batches in ``drop`` (a lossy network)."""

    def __init__(self, pub: KVEventPublisher) -> None:
        ctx = zmq.Context.instance()
        self.drop: set[int] = set()
        self.inbound = ctx.socket(zmq.SUB)
        self.inbound.setsockopt(zmq.SUBSCRIBE, b"")
        self.inbound.connect(pub.endpoint)
        self.outbound = ctx.socket(zmq.PUB)
        self.outbound.bind(LOCAL)
        self.endpoint = self.outbound.getsockopt_string(zmq.LAST_ENDPOINT)

    def pump(self) -> None:
        while self.inbound.poll(0):
            frames = self.inbound.recv_multipart()
            if int.from_bytes(frames[1], "big") not in self.drop:
                self.outbound.send_multipart(frames)

    def close(self) -> None:
        self.inbound.close(linger=0)
        self.outbound.close(linger=0)


def test_late_and_lossy_subscriber_catches_up(
    make_publisher: Callable[..., KVEventPublisher],
) -> None:
    pub = make_publisher()
    feed = Feed(pub)
    for i in range(10):  # nobody listens yet: these reach the subscriber only by replay
        feed.batch(BlockStored([digest("early", i)], None))
    relay = LossyRelay(pub)
    sub = KVEventSubscriber(relay.endpoint, pub.replay_endpoint, b"kv-events")
    got: list[Received] = []

    def step(i: int) -> None:
        feed.batch(BlockStored([digest("late", i)], digest("late", i - 1)))
        relay.pump()
        got.extend(sub.poll(10))

    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not got:  # until the subscriber is live (its first message triggers catch-up)
            assert time.monotonic() < deadline, "subscriber never went live"
            step(len(feed.events))
        relay.drop = set(range(pub.batches_sent + 2, pub.batches_sent + 7))
        for _ in range(10):
            step(len(feed.events))
        while not feed.all_sent(got[-1][1]):
            assert time.monotonic() < deadline, f"stuck at {got[-1][1]}"
            relay.pump()
            got.extend(sub.poll(10))
    finally:
        relay.close()
        sub.close()
    assert [seq for _, seq, _ in got] == list(range(pub.batches_sent))
    assert flat(got) == feed.events
    assert sub.replays_requested == 2 == pub.replays_served  # the head, then the gap
    assert sub.batches_replayed >= 15 and sub.take_notices() == []


# --- (4) a restarted publisher is a new epoch ------------------------------------------


def test_restart_is_a_new_epoch(make_publisher: Callable[..., KVEventPublisher]) -> None:
    first = make_publisher()
    sub = KVEventSubscriber(first.endpoint, first.replay_endpoint, b"kv-events")
    try:
        old = receive_all(sub, Feed(first))
        endpoints = (first.endpoint, first.replay_endpoint)
        first.close()
        second = make_publisher(*endpoints)  # same ports, as a restarted replica would bind
        assert second.epoch != first.epoch and second.topic != first.topic
        assert second.topic == f"kv-events.{second.epoch:016x}"
        feed = Feed(second)
        feed.batch(BlockStored([digest("after restart")], None))
        new = receive_all(sub, feed)
        notices = sub.take_notices()
    finally:
        sub.close()
    assert {t for t, _, _ in old} == {first.topic.encode()}
    assert {t for t, _, _ in new} == {second.topic.encode()}
    assert [seq for _, seq, _ in new] == list(range(second.batches_sent))
    assert flat(new) == feed.events
    assert notices == [EpochChange(b"kv-events", first.topic.encode(), second.topic.encode())]


# --- (5) never on the network by accident ----------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "replay"),
    [
        ("tcp://0.0.0.0:5557", None),
        ("tcp://*:5557", None),
        ("tcp://8.8.8.8:5557", None),
        ("tcp://[::]:5557", None),
        ("tcp://127.0.0.1:*", "tcp://*:5558"),
    ],
)
def test_non_loopback_bind_is_refused(endpoint: str, replay: str | None) -> None:
    with pytest.raises(ValueError, match=ALLOW_REMOTE_FLAG) as err:
        KVEventPublisher(endpoint, replay)
    assert (replay or endpoint) in str(err.value)


def test_loopback_forms_are_allowed(make_publisher: Callable[..., KVEventPublisher]) -> None:
    pub = make_publisher("tcp://localhost:*", "tcp://127.0.0.2:*")
    assert pub.endpoint.startswith("tcp://127.0.0.1:")
    assert pub.replay_endpoint is not None and pub.replay_endpoint.startswith("tcp://127.0.0.2:")


# --- (6) many engine threads at once ---------------------------------------------------


def test_concurrent_publishers_lose_nothing(
    make_publisher: Callable[..., KVEventPublisher],
    make_subscriber: Callable[..., KVEventSubscriber],
) -> None:
    pub = make_publisher(max_batch_events=64)
    sub = make_subscriber(pub)
    n_threads, per_thread = 4, 500
    mine = [
        [BlockStored([digest(t, i)], None, lora_id=t, block_size=i + 1) for i in range(per_thread)]
        for t in range(n_threads)
    ]
    start = threading.Barrier(n_threads)

    def worker(t: int) -> None:
        start.wait(timeout=TIMEOUT_S)
        for event in mine[t]:
            pub.publish(event)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S)
    feed = Feed(pub)
    feed.events = [e for events in mine for e in events]  # the count is what matters here
    received = [e for e in flat(receive_all(sub, feed)) if isinstance(e, BlockStored)]
    assert len(received) == n_threads * per_thread and pub.events_dropped == 0
    for t in range(n_threads):
        assert [e for e in received if e.lora_id == t] == mine[t]  # complete, in order
