"""Stored responses for ``previous_response_id`` and ``GET``/``DELETE /v1/responses/{id}``:
in memory, per tenant, bounded, with a TTL.

An entry is a conversation (its turns, the response's output last), token counts, the
response object as it was answered and its input items; it is never logged or exported.
Another tenant's id, an expired one, a deleted one and one made with ``store: false`` are
all simply absent.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from prefixcache.protocol.response_ids import new_instance, response_id
from prefixcache.protocol.tool_prompt import Turn

MAX_PER_TENANT = 256  # stored responses per tenant; the oldest goes first
MAX_CHARS_PER_TENANT = 16 * 2**20  # characters of stored conversations per tenant
TTL_SECONDS = 3600.0


@dataclass(frozen=True, slots=True)
class Stored:
    turns: tuple[Turn, ...]
    input_tokens: int
    output_tokens: int
    expires: float
    chars: int
    response: dict  # the response object, as answered
    input_items: tuple[dict, ...] = ()  # its own input, as items with ids


class ResponseStore:
    """Responses by (tenant, id); safe to use from the prepare threads and the loop."""

    def __init__(
        self,
        max_per_tenant: int = MAX_PER_TENANT,
        ttl: float = TTL_SECONDS,
        max_chars: int = MAX_CHARS_PER_TENANT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_per_tenant, self.ttl, self.clock = max_per_tenant, ttl, clock
        self.max_chars = max_chars
        self.instance = new_instance()  # in /health and in every id issued here
        self._by_tenant: dict[str, OrderedDict[str, Stored]] = {}
        self._chars: dict[str, int] = {}
        self._lock = threading.Lock()

    def put(self, tenant: str, response_id: str, record: Record) -> None:
        """Keep a response; the tenant's oldest beyond the bounds are dropped (a conversation
        larger than the whole character bound is not kept)."""
        turns = record.turns
        chars = sum(len(t.content) + sum(len(c.arguments) for c in t.calls) for t in turns)
        chars += len(json.dumps([record.response, record.input_items]))
        expires = self.clock() + self.ttl
        entry = Stored(
            tuple(turns), *record.counts, expires, chars, record.response, tuple(record.input_items)
        )
        with self._lock:
            entries = self._by_tenant.setdefault(tenant, OrderedDict())
            self._chars[tenant] = self._chars.get(tenant, 0) + chars
            entries[response_id] = entry
            while entries and (
                len(entries) > self.max_per_tenant or self._chars[tenant] > self.max_chars
            ):
                self._chars[tenant] -= entries.popitem(last=False)[1].chars

    def get(self, tenant: str, response_id: str) -> Stored | None:
        """The tenant's live response of that id, or None."""
        with self._lock:
            entries = self._by_tenant.get(tenant, OrderedDict())
            entry = entries.get(response_id)
            if entry is not None and entry.expires <= self.clock():
                del entries[response_id]
                self._chars[tenant] -= entry.chars
                return None
            return entry

    def delete(self, tenant: str, response_id: str) -> bool:
        """Forget the tenant's response of that id; whether it was there (and live)."""
        if self.get(tenant, response_id) is None:
            return False
        with self._lock:
            entry = self._by_tenant[tenant].pop(response_id, None)
            if entry is not None:
                self._chars[tenant] -= entry.chars
            return entry is not None

    def new_id(self) -> str:
        """An id for a new response: this replica's instance, then a random part."""
        return response_id(self.instance)

    def view(self, tenant: str) -> TenantResponses:
        return TenantResponses(self, tenant)


@dataclass(frozen=True, slots=True)
class TenantResponses:
    """One tenant's side of the store: all a request may see or add."""

    store: ResponseStore
    tenant: str

    def get(self, response_id: str) -> Stored | None:
        return self.store.get(self.tenant, response_id)

    def new_id(self) -> str:
        return self.store.new_id()

    def put(self, response_id: str, record: Record) -> None:
        self.store.put(self.tenant, response_id, record)

    def delete(self, response_id: str) -> bool:
        return self.store.delete(self.tenant, response_id)


@dataclass(frozen=True, slots=True)
class Record:
    """What a finished response saves: its conversation, counts, object and input items."""

    turns: list[Turn]
    counts: tuple[int, int]  # input and output tokens
    response: dict
    input_items: list[dict] = field(default_factory=list)
