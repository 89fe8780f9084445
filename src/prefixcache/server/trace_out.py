"""`--trace-out PATH`: one Mooncake-format line per finished request, for `simulate`.

Each line has the request's arrival (milliseconds since the server started), its input
and output lengths, and its full prompt blocks as ids, plus ``block_size``: never token
ids or text. An id stands for a block's portable chain digest (so it depends on the
tenant's salt and on every block before it); ids are numbered in order of first sight,
because the simulator packs ids into 32 bits and a truncated digest could collide.
Optional: ``cache_key``, the request's ``prompt_cache_key`` as an id numbered likewise per
(tenant, key), never the key; ``retention``, its ``[num_tokens, ttl_seconds]`` marks.
Lines are written by a background thread; the engine only queues a request's numbers.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from pathlib import Path

from prefixcache.cache import KVCacheManager
from prefixcache.engine.request import Request

log = logging.getLogger("prefixcache.server")


class TraceWriter:
    """Appends one line per retired request to ``path`` from its own thread."""

    def __init__(self, path: str | Path, manager: KVCacheManager) -> None:
        self.path = Path(path)
        self.manager = manager
        self.started = time.perf_counter()
        self._ids: dict[bytes, int] = {}
        self._key_ids: dict[str, int] = {}  # Request.cache_key (already opaque) -> id
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 -- closed in close()
        self._thread = threading.Thread(target=self._run, name="trace-out", daemon=True)
        self._thread.start()

    def record(self, request: Request) -> None:
        """Queue a retired request (called on the engine thread; cheap)."""
        outputs = sum(len(output.token_ids) for output in request.outputs)
        arrival = request.metrics.arrival_time
        keeps = [[keep.num_tokens, keep.ttl_seconds] for keep in request.retention]
        item = (request.prompt_token_ids, request.cache_salt, arrival, outputs)
        self._queue.put((*item, request.cache_key, keeps))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self._write(*item)
            except Exception:  # a bad line must not stop the trace
                log.exception("trace-out: a line could not be written")

    def _write(
        self,
        prompt: list[int],
        salt: str | None,
        arrival: float,
        outputs: int,
        cache_key: str | None = None,
        keeps: list[list[float]] | None = None,
    ) -> None:
        digests = self.manager.prompt_digests(prompt, salt, cap_last_token=False)
        line = {
            "timestamp": round((arrival - self.started) * 1000, 3),
            "input_length": len(prompt),
            "output_length": outputs,
            "hash_ids": [self._ids.setdefault(d, len(self._ids)) for d in digests],
            "block_size": self.manager.block_size,
        }
        if cache_key is not None:
            line["cache_key"] = self._key_ids.setdefault(cache_key, len(self._key_ids))
        if keeps:
            line["retention"] = keeps
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Write what is queued, then close the file."""
        self._queue.put(None)
        self._thread.join(timeout=10)
        self._file.close()
