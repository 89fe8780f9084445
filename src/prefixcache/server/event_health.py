"""How the KV-event publisher is doing: failures by kind, rejected replay requests, up or down.

The publisher thread writes; ``/health`` and ``/metrics`` read (plain counters: a reader may
see an update late, never a torn one). Events are *down* after ``MAX_FAILURES_IN_A_ROW``
failed restarts of the publisher's loop, and *ok* again after its next good round.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from prefixcache.protocol.kv_events import REPLAY_PROBLEMS

MAX_FAILURES_IN_A_ROW = 5  # failed restarts before events are marked down
FIRST_BACKOFF_S = 0.01  # pause after the first failure; doubles with each one in a row
MAX_BACKOFF_S = 1.0
FAILURE_KINDS = ("poll", "replay", "publish", "sockets")  # the step that failed


@dataclass(slots=True)
class EventsHealth:
    """The publisher's failure and rejection counts, and whether events are up."""

    failures: Counter[str] = field(default_factory=Counter)  # by FAILURE_KINDS
    rejected: Counter[str] = field(default_factory=Counter)  # by REPLAY_PROBLEMS
    in_a_row: int = 0
    down: bool = False

    @property
    def status(self) -> str:
        return "down" if self.down else "ok"

    def failed(self, kind: str) -> float:
        """Count a failure of step ``kind``; the pause before restarting the loop."""
        self.failures[kind] += 1
        self.in_a_row += 1
        if self.in_a_row >= MAX_FAILURES_IN_A_ROW:
            self.down = True
        return min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** (self.in_a_row - 1))

    def round_ok(self) -> bool:
        """A round of the loop went through; True if that brings events back up."""
        self.in_a_row = 0
        came_back, self.down = self.down, False
        return came_back

    def reject(self, problem: str) -> int:
        """Count a malformed replay request; how many of its kind so far."""
        self.rejected[problem] += 1
        return self.rejected[problem]


class PublisherView(Protocol):
    """What the collector reads from a ``KVEventPublisher``."""

    health_state: EventsHealth
    events_dropped: int
    batches_sent: int
    replays_served: int
    epochs: int

    @property
    def up(self) -> bool: ...


class EventsCollector:
    """The publisher's numbers at scrape time (register it on the server's registry)."""

    def __init__(self, publisher: PublisherView) -> None:
        self.publisher = publisher

    def collect(self) -> Iterator[Metric]:
        pub, state = self.publisher, self.publisher.health_state
        yield GaugeMetricFamily(
            "prefixcache_kv_events_up", "1 while KV events are published, 0 once down", pub.up
        )
        yield _by_label(
            "kv_events_failures", "Publisher loop failures, by step", "kind", state.failures,
            FAILURE_KINDS,
        )  # fmt: skip
        yield _by_label(
            "kv_events_replay_rejected", "Malformed replay requests, by problem", "problem",
            state.rejected, REPLAY_PROBLEMS,
        )  # fmt: skip
        counters = [
            ("kv_events_dropped", "KV events never published (queue full, closed, unencodable)",
             pub.events_dropped),
            ("kv_events_batches", "KV event batches published", pub.batches_sent),
            ("kv_events_replays", "Replay requests answered with batches", pub.replays_served),
            ("kv_events_epochs", "Event streams started (one per boot, one per loss)", pub.epochs),
        ]  # fmt: skip
        for name, documentation, value in counters:
            yield CounterMetricFamily(f"prefixcache_{name}", documentation, value=value)


def _by_label(
    name: str, documentation: str, label: str, counts: Counter[str], names: tuple[str, ...]
) -> CounterMetricFamily:
    """A counter with one sample per known label value (zeros included)."""
    family = CounterMetricFamily(f"prefixcache_{name}", documentation, labels=[label])
    for value in names:
        family.add_metric([value], counts[value])
    return family
