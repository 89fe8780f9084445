"""Free loopback ports for the servers the tests start, never handed out twice in a run.

A port found free is free only until the child given it binds it: another xdist worker, an
outgoing connection, or this worker asking again before then could take it ("Address
already in use", seen in a 3-worker run). So ports come from below Linux's ephemeral range
(no outgoing connection is given one), each worker takes only those of its own residue
class (port modulo the number of workers), and a process never hands one out twice.
(Filtering the ports ``bind(0)`` picks does not work: Linux gives odd ones first.)
"""

from __future__ import annotations

import os
import random
import socket

LOW, HIGH = 20000, 32768  # below the ephemeral range (32768-60999 by default)
_GIVEN: set[int] = set()


def _worker_class() -> tuple[int, int]:
    """(this xdist worker's index, the number of workers); (0, 1) outside xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1), 1)
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0
    return index % count, count


def free_port(also_free_at: int | None = None) -> int:
    """A loopback port free now, of this worker's class, not given before in this process;
    with ``also_free_at``, the port that many above it is free too (a Redis cluster bus)."""
    index, count = _worker_class()
    for _ in range(10_000):
        port = random.randrange(LOW + index, HIGH, count)
        ports = [port] if also_free_at is None else [port, port + also_free_at]
        if all(p not in _GIVEN and _bindable(p) for p in ports):
            _GIVEN.update(ports)
            return port
    raise RuntimeError(f"no free loopback port in [{LOW}, {HIGH}) for worker {index}")


def _bindable(port: int) -> bool:
    if port >= 65536:
        return False
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
