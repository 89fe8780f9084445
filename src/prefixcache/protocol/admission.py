"""Admission: the global and per-tenant in-flight limits (HTTP 429 with Retry-After).

A request holds a ``Ticket`` from the moment it is authenticated (one unit, before its body
is read) until its response ends; once prepared it holds one unit per engine request. No
more than ``max_pending`` units are held in all, so at most that many bodies are buffered at
once (``max_pending`` x ``--max-body-bytes`` of memory), with or without tenants.
Everything here runs on the event loop, so a check and its reservation cannot interleave.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Gauge

from prefixcache.protocol.errors import ApiError
from prefixcache.protocol.limits import RETRY_AFTER_SECONDS

RETRY_AFTER = {"Retry-After": str(RETRY_AFTER_SECONDS)}


@dataclass(slots=True)
class Ticket:
    """What one request holds of its tenant's share."""

    tenant: str
    units: int = 0


class InFlight:
    """Units held per tenant, against ``tenant_share`` (None: one local tenant, no share)."""

    def __init__(self, max_pending: int, tenant_share: int | None) -> None:
        self.max_pending = max_pending
        self.tenant_share = tenant_share
        self._held: Counter[str] = Counter()

    def held(self, tenant: str) -> int:
        return self._held[tenant]

    @property
    def total(self) -> int:
        """Units held by every tenant: requests being read, prepared or served."""
        return sum(self._held.values())

    def enter(self, tenant: str) -> Ticket:
        """One unit for a request that has just arrived, or 429: when ``max_pending`` units
        are held in all (bodies being read or prepared count), or its tenant's share is."""
        total = self.total
        if total >= self.max_pending:
            raise ApiError(
                429,
                f"server overloaded: {total} requests being read, prepared or served (limit "
                f"{self.max_pending}, --max-pending); retry later",
                headers=dict(RETRY_AFTER),
            )
        ticket = Ticket(tenant)
        self._resize(ticket, 1)
        return ticket

    def admit(self, ticket: Ticket, count: int, pending: int) -> None:
        """Hold ``count`` engine requests, or 429 (``pending``: the engine's in flight now)."""
        if pending + count > self.max_pending:
            raise ApiError(
                429,
                f"server overloaded: {pending} requests pending (limit {self.max_pending}, "
                "--max-pending); retry later",
                headers=dict(RETRY_AFTER),
            )
        self._resize(ticket, count)

    def leave(self, ticket: Ticket) -> None:
        """Give back everything ``ticket`` holds (safe to repeat)."""
        self._held[ticket.tenant] -= ticket.units
        ticket.units = 0
        if self._held[ticket.tenant] <= 0:
            del self._held[ticket.tenant]

    def _resize(self, ticket: Ticket, units: int) -> None:
        held = self._held[ticket.tenant] - ticket.units
        if self.tenant_share is not None and held + units > self.tenant_share:
            raise ApiError(
                429,
                f"tenant {ticket.tenant!r} has {held + ticket.units} requests in flight (limit "
                f"{self.tenant_share}, --max-pending-per-tenant); retry later",
                headers=dict(RETRY_AFTER),
            )
        self._held[ticket.tenant] = held + units
        ticket.units = units


def export_pending(in_flight: InFlight, registry: CollectorRegistry, name: str) -> None:
    """A gauge `name` on `registry`: the units `in_flight` holds, read at scrape time."""
    gauge = Gauge(
        name,
        "Requests held: being read, prepared or served (units, against --max-pending)",
        registry=registry,
    )
    gauge.set_function(lambda: in_flight.total)
