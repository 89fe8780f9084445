"""argparse value types shared by every subcommand."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def _bounded(
    text: str,
    convert: Callable[[str], float],
    noun: str,
    ok: Callable[[float], bool],
    bound: str,
    spec: str = "",
):
    """``text`` converted; a usage error naming the bound unless ``ok(value)`` holds
    (``spec``: how the value is shown in it)."""
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"{value:{spec}} must be {bound}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1, with a message naming the limit (a usage error, not a traceback)."""
    return _bounded(text, int, "an integer", lambda v: v >= 1, ">= 1")


def positive_seconds(text: str) -> float:
    """A number of seconds > 0 (a usage error otherwise)."""
    return _bounded(text, float, "a number", lambda v: v > 0, "> 0")


def non_negative_int(text: str) -> int:
    """An integer >= 0 (a usage error otherwise)."""
    return _bounded(text, int, "an integer", lambda v: v >= 0, ">= 0")


def unit_share(text: str) -> float:
    """A share in [0, 1] (a usage error otherwise)."""
    return _bounded(text, float, "a number", lambda v: 0 <= v <= 1, "in [0, 1]", "g")
