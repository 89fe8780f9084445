"""A consistent-hash ring: removing a node moves only the keys that node owned."""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterable

DEFAULT_VNODES = 100  # points per node: enough for an even split among a few replicas


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")


class HashRing:
    """Nodes at ``vnodes`` pseudo-random points each; a key goes to the next point clockwise."""

    def __init__(self, nodes: Iterable[str], vnodes: int = DEFAULT_VNODES) -> None:
        points = sorted(
            (_point(f"{node}#{i}".encode()), node) for node in set(nodes) for i in range(vnodes)
        )
        assert points, "a ring needs at least one node"
        self._keys = [key for key, _ in points]
        self._nodes = [node for _, node in points]

    def node_for(self, key: bytes) -> str:
        """The node owning ``key`` (any bytes; a block digest here)."""
        position = bisect.bisect(self._keys, _point(key)) % len(self._keys)
        return self._nodes[position]
