"""The ``serve`` options ``cluster`` and ``ray`` pass on to every replica they start: one
definition, so both commands take the same ones with the same checks."""

from __future__ import annotations

import argparse
from collections.abc import Iterable

from prefixcache.argtypes import non_negative_int, unit_share

# (flag, argparse keywords): each replica's own `serve` option of the same name
REPLICA_OPTIONS: tuple[tuple[str, dict], ...] = (
    ("--kv-cache-bytes", {"type": int, "help": "each replica's KV pool"}),
    ("--kv-cache-dtype", {"metavar": "DTYPE", "help": "each replica's `serve --kv-cache-dtype`"}),
    ("--kv-layout", {"metavar": "LAYOUT", "help": "each replica's `serve --kv-layout`"}),
    ("--retention-budget", {"type": unit_share, "help": "each replica's default retention share"}),
    (
        "--step-target-ms",
        {"type": non_negative_int, "help": "each replica's `serve --step-target-ms`"},
    ),
)


def add_replica_flags(parser: argparse.ArgumentParser) -> None:
    """Every ``REPLICA_OPTIONS`` flag (unset: the replica's own default)."""
    for flag, keywords in REPLICA_OPTIONS:
        parser.add_argument(flag, **keywords)


def replica_flags(args: argparse.Namespace) -> list[str]:
    """The ones set, as a command line for ``serve``."""
    return set_flags(
        (flag, getattr(args, flag[2:].replace("-", "_"), None)) for flag, _ in REPLICA_OPTIONS
    )


def set_flags(pairs: Iterable[tuple[str, object]]) -> list[str]:
    """``flag value`` for each pair whose value is set (not None): a child's command line."""
    return [part for flag, value in pairs if value is not None for part in (flag, str(value))]
