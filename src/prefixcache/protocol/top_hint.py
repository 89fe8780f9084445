"""What ``serve``, ``cluster`` and ``ray`` say at start-up: the ``prefixcache top`` command
that watches them (docs/debugging.md#prefixcache-top-url-a-live-view-of-a-replica-or-a-cluster)."""

from __future__ import annotations

WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "*", "")


def local_url(host: str, port: int) -> str:
    """Where this machine reaches a server bound to ``host`` (loopback for every address)."""
    host = "127.0.0.1" if host in WILDCARD_HOSTS else host.strip("[]")
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def watch_line(url: str, keyed: bool) -> str:
    """The command that watches the server at ``url`` (``keyed``: it has a key file)."""
    return f"watch it: prefixcache top {url}" + (" --api-key <an admin key>" if keyed else "")
