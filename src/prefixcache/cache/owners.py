"""Owners of cached blocks (tenants): names, cache shares, and who evicted whom.

A fair pool (``OwnerParts`` in a ``BlockPool``) charges each free cached block to one
owner: the owner of the request whose release dropped its refcount to 0 (the last user).
When it must evict, it takes from the owner whose free cached blocks most exceed its share
of all free cached blocks (``most_over_share``). Shares bind only under contention: an
owner alone may fill the pool, and an idle owner's unused share is the others'.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

MAX_OWNERS = 256  # each owner has its own policy over the pool's block ids


def check_shares(shares: Mapping[str, float]) -> dict[str, float]:
    """Each share a number in (0, 1], all together at most 1; ValueError naming the owner."""
    if not isinstance(shares, Mapping):
        raise ValueError(f"owner_shares must be a dict of owner -> share, got {shares!r}")
    checked = {}
    for name, share in shares.items():
        if not isinstance(name, str):
            raise ValueError(f"owner_shares: owner names are strings, got {name!r}")
        valid = isinstance(share, (int, float)) and not isinstance(share, bool)
        if not valid or not math.isfinite(share) or not 0 < share <= 1:
            raise ValueError(f"cache share of {name!r} must be a number in (0, 1], got {share!r}")
        checked[name] = float(share)
    total = sum(checked.values())
    if total > 1 + 1e-9:
        raise ValueError(f"cache shares sum to {total:g}; at most 1 (the whole pool)")
    if len(checked) > MAX_OWNERS:
        raise ValueError(f"owner_shares names {len(checked)} owners; at most {MAX_OWNERS}")
    return checked


def most_over_share(held: Sequence[int], shares: Sequence[float]) -> int:
    """The owner (index) whose held blocks most exceed its share of their sum; ties: lowest.

    Only owners holding blocks are candidates, so the answer always has one to give.
    """
    total = sum(held)
    best, most = -1, -math.inf
    for owner, count in enumerate(held):
        if count and count - shares[owner] * total > most:
            best, most = owner, count - shares[owner] * total
    return best


@dataclass(frozen=True, slots=True)
class OwnerUsage:
    """One owner's part of a fair pool, for metrics and reports (counts only)."""

    name: str | None
    share: float
    cached_blocks: int  # free cached blocks charged to it now
    evictions_suffered: int  # its blocks evicted to make room
    evictions_caused: int  # blocks evicted to make room for its requests


class Owners:
    """Owner name <-> small id, each owner's share, and per-owner eviction counters.

    Owners named in ``shares`` have that share; every other owner seen so far gets an equal
    part of the rest (so ``{}`` means equal shares). Ids are handed out on first use.
    """

    def __init__(self, shares: Mapping[str, float]) -> None:
        self.listed = check_shares(shares)
        self.names: list[str | None] = []
        self.ids: dict[str | None, int] = {}
        self.shares: list[float] = []
        self.suffered: list[int] = []
        self.caused: list[int] = []

    def id_of(self, name: str | None) -> int:
        """The id of owner ``name``, registered now if it is new."""
        found = self.ids.get(name)
        return self._register(name) if found is None else found

    def _register(self, name: str | None) -> int:
        """A new id; lists grow before ``names``, so a reader (a metrics scrape) never sees a
        name without its share and counters."""
        if len(self.names) >= MAX_OWNERS:
            raise ValueError(
                f"owner {name!r} would be owner {MAX_OWNERS + 1}; at most {MAX_OWNERS}"
            )
        self.suffered.append(0)
        self.caused.append(0)
        self.shares = self._shares([*self.names, name])
        self.names.append(name)
        owner = self.ids[name] = len(self.names) - 1
        return owner

    def _shares(self, names: list[str | None]) -> list[float]:
        """Listed owners keep their share; the unlisted ones split the rest equally."""
        listed = self.listed
        unlisted = sum(1 for name in names if name not in listed)
        rest = max(0.0, 1.0 - sum(listed.values()))
        each = rest / unlisted if unlisted else 0.0
        return [listed.get(name, each) if name is not None else each for name in names]

    def count_eviction(self, victim: int, cause: int) -> None:
        self.suffered[victim] += 1
        self.caused[cause] += 1
