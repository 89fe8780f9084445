"""A clock a test moves by hand: expiries and TTLs without sleeping."""

from __future__ import annotations


class FakeClock:
    """Seconds that move only when a test says so (``now`` may be set, or ``advance``d)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
