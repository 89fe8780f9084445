"""The KV-event flags ``serve`` and ``cluster`` share (the wire form and a fixed topic), and
whether an endpoint stays on this machine (``--kv-events-allow-remote`` otherwise)."""

from __future__ import annotations

import argparse
import ipaddress

from prefixcache.protocol.kv_events import MAX_TOPIC_CHARS, WIRE_FORMATS, check_topic
from prefixcache.protocol.replica_flags import set_flags


def add_event_format_flags(parser: argparse.ArgumentParser) -> None:
    """``--kv-events-format`` and ``--kv-events-topic``."""
    parser.add_argument(
        "--kv-events-format",
        choices=WIRE_FORMATS,
        default=WIRE_FORMATS[0],
        help='events as vLLM\'s tagged arrays (default) or as maps tagged by "type"',
    )
    parser.add_argument(
        "--kv-events-topic",
        type=event_topic,
        metavar="TOPIC",
        help=f"a fixed topic, e.g. kv@POD@MODEL for llm-d (1-{MAX_TOPIC_CHARS} printable "
        "characters); default: kv-events.<random epoch per boot>",
    )


def event_topic(value: str) -> str:
    """``--kv-events-topic``: checked, or an argparse error naming the limit."""
    try:
        return check_topic(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def event_format_args(args: argparse.Namespace) -> list[str]:
    """The two flags, where set, as a command line (``cluster`` passes them on to replicas)."""
    return set_flags(
        (
            ("--kv-events-format", getattr(args, "kv_events_format", None)),
            ("--kv-events-topic", getattr(args, "kv_events_topic", None)),
        )
    )


def is_loopback_endpoint(endpoint: str) -> bool:
    """True for ipc/inproc and tcp on 127.0.0.0/8, ::1 or localhost; False for ``*``."""
    scheme, _, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    host = rest.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", an interface name or a host name: could be any address
