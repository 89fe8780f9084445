"""argparse value types shared by every subcommand."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An integer >= 1, with a message naming the limit (a usage error, not a traceback)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value
