"""A server's ``/metrics`` as numbers, and the last minute of them kept by the view itself:
rates "over the last minute" are differences between its own scrapes, never server state."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

Labels = tuple[tuple[str, str], ...]
WINDOW_S = 60.0


@dataclass(frozen=True, slots=True)
class Samples:
    """One scrape: every sample by (name, sorted labels), taken at ``at`` (monotonic s)."""

    at: float
    values: dict[tuple[str, Labels], float]

    def get(self, name: str, **labels: str) -> float | None:
        """The sum of ``name``'s samples whose labels include ``labels``; None if none."""
        found = [v for (n, have), v in self.values.items() if n == name and _has(have, labels)]
        return sum(found) if found else None

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """``name``'s samples summed by the value of one label."""
        out: dict[str, float] = {}
        for (n, have), v in self.values.items():
            value = dict(have).get(label)
            if n == name and value is not None:
                out[value] = out.get(value, 0.0) + v
        return out


def _has(have: Labels, wanted: dict[str, str]) -> bool:
    labels = dict(have)
    return all(labels.get(k) == v for k, v in wanted.items())


def parse(text: str, at: float) -> Samples:
    """Prometheus text as ``Samples``; ValueError if it is not Prometheus text."""
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return Samples(at, values)


class Window:
    """The scrapes of one server over the last ``span`` seconds, oldest first."""

    def __init__(self, span: float = WINDOW_S) -> None:
        self.span = span
        self.scrapes: deque[Samples] = deque()

    def add(self, samples: Samples) -> None:
        """Keep ``samples``; forget those older than the span (and all after a restart)."""
        if self.scrapes and _restarted(self.scrapes[-1], samples):
            self.scrapes.clear()
        self.scrapes.append(samples)
        while samples.at - self.scrapes[0].at > self.span:
            self.scrapes.popleft()

    @property
    def latest(self) -> Samples | None:
        return self.scrapes[-1] if self.scrapes else None

    @property
    def seconds(self) -> float:
        """What the changes cover: 0.0 with one scrape (then they count since start)."""
        return self.scrapes[-1].at - self.scrapes[0].at if self.scrapes else 0.0

    def change(self, name: str, **labels: str) -> float | None:
        """How much counter ``name`` grew over the window (since start with one scrape)."""
        if not self.scrapes:
            return None
        last = self.scrapes[-1].get(name, **labels)
        if last is None:
            return None
        first = self.scrapes[0].get(name, **labels) if len(self.scrapes) > 1 else 0.0
        return last - (first or 0.0)

    def changes(self, name: str, label: str) -> Iterator[tuple[str, float]]:
        """``change`` of each value of ``label`` of counter ``name``."""
        if not self.scrapes:
            return
        first = self.scrapes[0].by_label(name, label) if len(self.scrapes) > 1 else {}
        for value, last in self.scrapes[-1].by_label(name, label).items():
            yield value, last - first.get(value, 0.0)


RESTART_COUNTER = "prefixcache_prefix_cache_queries_tokens_total"


def _restarted(before: Samples, after: Samples) -> bool:
    """A counter went backwards: the server restarted between the two scrapes."""
    old, new = before.get(RESTART_COUNTER), after.get(RESTART_COUNTER)
    return old is not None and new is not None and new < old
