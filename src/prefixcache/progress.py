"""Progress of long work on a terminal: a replay, the weight cache's first build, the
kernels' build. A tqdm bar on stderr while stderr is a terminal; nothing otherwise (logs,
pipes, CI), so output that is read by a program never changes."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import TypeVar

Progress = Callable[[int], object]  # advance the bar by n
V = TypeVar("V")


@contextlib.contextmanager
def progress_bar(
    total: int, desc: str, unit: str = "it", quiet: bool = False
) -> Iterator[Progress | None]:
    """A bar of ``total`` steps on a terminal's stderr (cleared when done); None when quiet,
    when stderr is not a terminal, or with nothing to do."""
    stream = sys.stderr
    if quiet or total <= 0 or stream is None or not stream.isatty():
        yield None
        return
    from tqdm import tqdm  # here: importing this module stays cheap

    with tqdm(total=total, unit=unit, desc=desc, leave=False, file=stream) as bar:
        yield bar.update


class Ticking(Mapping[str, V]):
    """A read-only view of ``items`` that advances ``advance`` once per key first found:
    progress through work that looks each item up as it gets to it."""

    def __init__(self, items: Mapping[str, V], advance: Progress) -> None:
        self.items, self.advance, self.seen = items, advance, set()

    def __getitem__(self, key: str) -> V:
        value = self.items[key]
        if key not in self.seen:
            self.seen.add(key)
            self.advance(1)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)
