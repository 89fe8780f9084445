"""What runs between the layers of a long prompts' step (``Scheduler.interleave``).

The engine calls back between the layers: a driver's ``arrivals`` hook takes the requests
that arrived meanwhile (on the engine thread), and the urgent step that is due runs. Its
outputs go out at once through ``on_outputs`` (the async engine streams them), else they
are held and returned with the long step's own.
"""

from __future__ import annotations

from collections.abc import Callable

from prefixcache.engine.request import RequestOutput


class BetweenLayers:
    """A driver's hooks, and the urgent steps' seconds and held outputs."""

    def __init__(self) -> None:
        self.arrivals: Callable[[], object] | None = None  # take requests that arrived
        self.on_outputs: Callable[[list[RequestOutput]], None] | None = None  # deliver now
        self.seconds = 0.0  # spent between layers, in all (not the long step's own time)
        self._held: list[RequestOutput] = []

    def take_arrivals(self) -> None:
        if self.arrivals is not None:
            self.arrivals()

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """An urgent step's outputs: to the driver now, or held for the long step's end."""
        if self.on_outputs is not None:
            self.on_outputs(outputs)
        else:
            self._held.extend(outputs)

    def release(self) -> list[RequestOutput]:
        """The held outputs, in order; none are held after."""
        held, self._held = self._held, []
        return held
