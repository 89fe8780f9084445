"""One replica's KV events into the global index, on a thread of its own.

On start the feed asks the replica's replay socket for every batch from seq 0 (what it
cached before the router came up, or while the router was down), then reads the live
stream through ``KVEventSubscriber``, which fills gaps by replay. A batch already applied
from the first replay is skipped, so each batch counts once. A new topic (the replica's
epoch changed: it restarted) clears the replica's entries before its new events apply.

The router scores on full-attention KV cache groups only: a window group holds only the
last blocks its requests read, and its removals say nothing of the full layers. A feed
learns each ``group_idx``'s kind from its ``BlockStored`` events and skips the window
groups' events (a nil ``group_idx``, from an older vLLM, reads as 0: the one full group).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import NamedTuple

import zmq

from prefixcache.cache.events import (
    SLIDING_WINDOW,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from prefixcache.protocol.event_subscriber import (
    BatchesLost,
    EpochChange,
    KVEventSubscriber,
    stream_of,
)
from prefixcache.protocol.kv_events import decode_batch, request_replay
from prefixcache.router.index import GlobalIndex

log = logging.getLogger(__name__)

POLL_MS = 50  # how long a poll waits: also how quickly stop() is noticed
REPLAY_TIMEOUT_S = 2.0
MAX_GROUPS = 256  # group kinds a feed remembers (a peer cannot grow it without bound)


class EventEndpoints(NamedTuple):
    """Where a replica publishes (from its ``/health``)."""

    endpoint: str
    replay: str | None
    topic: str


@dataclass(slots=True)
class FeedStats:
    """What a feed has done (read by the router's /health and /metrics)."""

    batches: int = 0
    events: int = 0
    replayed: int = 0
    lost: int = 0
    epochs: int = 0


def replay_from(
    endpoint: str, start: int, timeout_s: float = REPLAY_TIMEOUT_S
) -> list[tuple[int, bytes]]:
    """Every batch the replay socket still buffers with ``seq >= start``, in order.

    A DEALER speaking the replay exchange of ``prefixcache.protocol.kv_events``; on a timeout it
    returns what arrived (the live feed's gap replay catches the rest up).
    """
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        got, complete = request_replay(dealer, start, timeout_s)
        if not complete:
            log.warning("KV events replay from %s timed out after %.1fs", endpoint, timeout_s)
        return got
    finally:
        dealer.close(linger=0)


class EventFeed:
    """Keeps ``replica``'s entries in ``index`` in step with its events (a daemon thread)."""

    def __init__(
        self,
        replica: str,
        events: EventEndpoints,
        index: GlobalIndex,
        tier_medium: str | None,
        *,
        poll_ms: int = POLL_MS,
    ) -> None:
        self.replica, self.events, self.index = replica, events, index
        self.topic = events.topic.encode()
        self.stats = FeedStats()
        self.synced = threading.Event()  # set once the first replay has been applied
        self._generation = index.attach(replica, tier_medium)
        self._applied = -1  # last seq applied on self.topic
        self._full_groups: dict[int, bool] = {}  # group_idx -> full attention, as learned
        self._poll_ms = poll_ms
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-feed {replica}", daemon=True)

    def start(self) -> EventFeed:
        self._thread.start()
        return self

    def stop(self, join_s: float = 0.0) -> None:
        """Stop reading; entries are the caller's to drop (``index.detach``)."""
        self._stop.set()
        if join_s:
            self._thread.join(join_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def _run(self) -> None:
        topic_filter = stream_of(self.topic)
        try:
            with KVEventSubscriber(self.events.endpoint, self.events.replay, topic_filter) as sub:
                self._initial_replay()
                self.synced.set()
                while not self._stop.is_set():
                    batches = sub.poll(self._poll_ms)
                    self._note(sub.take_notices())  # a restart clears before its batches
                    for topic, seq, events in batches:
                        self._apply(topic, seq, events)
        except Exception:  # a feed must never take the router down; the replica resyncs later
            log.exception("KV event feed of %s failed", self.replica)
        finally:
            self.synced.set()

    def _initial_replay(self) -> None:
        """Apply everything the replica still buffers (replay on connect, from seq 0)."""
        if self.events.replay is None:
            return
        batches = replay_from(self.events.replay, 0)
        for seq, payload in batches:
            try:
                _, events = decode_batch(payload)
            except Exception:
                self.stats.lost += 1
                continue
            self._apply(self.topic, seq, events)
        self.stats.replayed += len(batches)
        log.info("replica %s: replayed %d KV event batches", self.replica, len(batches))

    def _apply(self, topic: bytes, seq: int, events: list[KVEvent]) -> None:
        """One batch, in order; a new topic first clears the replica (new epoch)."""
        if self._stop.is_set():
            return
        if topic != self.topic and not self._new_epoch(topic):
            return
        if seq <= self._applied:
            return  # already applied by the first replay
        self._applied = seq
        self.stats.batches += 1
        self.stats.events += len(events)
        for event in events:
            self._apply_event(event)

    def _apply_event(self, event: KVEvent) -> None:
        if isinstance(event, BlockStored):
            if self._learn(event):
                self.index.store(self.replica, self._generation, event.block_hashes, event.medium)
        elif isinstance(event, BlockRemoved):
            if self._is_full(event.group_idx):
                self.index.remove(self.replica, self._generation, event.block_hashes, event.medium)
        elif isinstance(event, AllBlocksCleared):
            self.index.clear_pool(self.replica, self._generation)

    def _learn(self, event: BlockStored) -> bool:
        """Remember the kind of ``event``'s group; whether it is a full-attention group."""
        full = event.kv_cache_spec_kind != SLIDING_WINDOW
        groups = self._full_groups
        if event.group_idx in groups or len(groups) < MAX_GROUPS:
            groups[event.group_idx] = full
        return full

    def _is_full(self, group: int) -> bool:
        """A group learned as full, or group 0 before any of its events (vLLM's one group)."""
        return self._full_groups.get(group, group == 0)

    def _new_epoch(self, topic: bytes) -> bool:
        """The replica restarted: drop its entries and follow the new topic from seq 0."""
        generation = self.index.restart(self.replica, self._generation)
        if generation is None:  # detached meanwhile: this feed is obsolete
            self._stop.set()
            return False
        log.info(
            "replica %s: new KV events epoch %s, its index entries cleared",
            self.replica,
            topic.decode(errors="replace"),
        )
        self._generation, self.topic, self._applied = generation, topic, -1
        self._full_groups.clear()  # a restarted replica may have another layout
        self.stats.epochs += 1
        return True

    def _note(self, notices: list[EpochChange | BatchesLost]) -> None:
        """Count what replay could not return (entries may be stale until the next events);
        a restart on a fixed topic (no new epoch suffix) clears the replica here."""
        for notice in notices:
            if isinstance(notice, EpochChange) and notice.new_topic == self.topic:
                self._new_epoch(notice.new_topic)  # a fixed topic: seq went back to 0
            if isinstance(notice, BatchesLost):
                self.stats.lost += notice.last - notice.first + 1
                log.warning(
                    "replica %s: KV event batches %d..%d lost",
                    self.replica,
                    notice.first,
                    notice.last,
                )
