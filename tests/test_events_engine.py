"""End to end: the engine's KV events on the wire rebuild exactly what its pool holds."""

from __future__ import annotations

import random
import time

import msgpack
import zmq

from engine_fixtures import assert_pool_clean, run_to_completion, tiny_engine
from prefixcache.engine.sampling import SamplingParams
from prefixcache.server.events import KVEventPublisher, sink_for

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


class RawSubscriber:
    """Decodes frames the way vLLM's example subscriber does: only pyzmq and msgpack."""

    def __init__(self, endpoint: str) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.connect(endpoint)
        self.digests: set[bytes] = set()
        self.last_seq = -1

    def drain(self, until_seq: int, timeout: float = 10.0) -> None:
        """Apply every batch up to ``until_seq``; sequence numbers must be consecutive."""
        deadline = time.monotonic() + timeout
        while self.last_seq < until_seq:
            assert time.monotonic() < deadline, f"stuck at seq {self.last_seq} < {until_seq}"
            if not self.socket.poll(100):
                continue
            _topic, seq_bytes, payload = self.socket.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            assert seq == self.last_seq + 1, f"gap: {self.last_seq} -> {seq}"
            self.last_seq = seq
            _ts, events, *_ = msgpack.unpackb(payload, raw=False)
            for event in events:
                self.apply(event)

    def apply(self, event: list) -> None:
        tag = event[0]
        if tag == "BlockStored" and event[6] == "cpu":
            self.digests.update(event[1])
        elif tag == "BlockRemoved" and event[2] == "cpu":
            self.digests.difference_update(event[1])
        elif tag == "AllBlocksCleared":
            self.digests.clear()

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


def pool_digests(engine) -> set[bytes]:
    return {block.digest for block in engine.manager.pool.cached.values()}


def published_seq(publisher: KVEventPublisher, timeout: float = 10.0) -> int:
    """The last sequence number, once everything queued so far is sent."""
    deadline = time.monotonic() + timeout
    while publisher._queue and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)  # the batch in flight
    return publisher.batches_sent - 1


def test_a_raw_subscriber_rebuilds_the_pool_after_eviction_duplicates_and_a_reset():
    publisher = KVEventPublisher("tcp://127.0.0.1:*")
    subscriber = RawSubscriber(publisher.endpoint)
    time.sleep(0.2)  # let SUB join before anything is published
    engine = tiny_engine(num_kv_blocks=24, block_size=4)
    engine.set_event_sink(sink_for(publisher, include_token_ids=False))
    rng = random.Random(5)
    documents = [[rng.randrange(300, 3000) for _ in range(rng.randrange(6, 30))] for _ in range(4)]
    for round_index in range(8):
        for index in range(rng.randrange(1, 4)):  # a few at once: in-batch sharing
            prompt = rng.choice(documents) + [rng.randrange(300, 3000)]
            params = SamplingParams(
                temperature=0, max_tokens=5, ignore_eos=True, n=rng.choice((1, 2))
            )
            min_hit = rng.choice((0, 0, 10_000))  # a refused hit is recomputed: a duplicate
            engine.add_request(f"r{round_index}.{index}", prompt, params, min_hit_tokens=min_hit)
        run_to_completion(engine)
        subscriber.drain(published_seq(publisher))
        assert subscriber.digests == pool_digests(engine), f"round {round_index}"
        if round_index == 4:
            assert engine.manager.reset()
    assert engine.manager.stats.evictions > 0 and engine.manager.stats.duplicate_blocks > 0
    assert_pool_clean(engine)
    subscriber.close()
    publisher.close()
