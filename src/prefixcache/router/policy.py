"""Routing policies: which healthy replica gets a request.

Each policy sees the prompt's block digests and one ``Candidate`` per healthy replica
(its load, and for ``cache-aware`` its cached prefix from the index) and returns a
``Choice``. They are pure: no I/O, no clock, so every one is tested on hand-made input.

``cache-aware`` (the default) minimises, per replica::

    cost = (prompt_blocks - pool_blocks - tier_weight * tier_blocks) + load_weight * load

where ``pool_blocks`` is the longest leading run of the prompt's blocks in the replica's
pool, ``tier_blocks`` the run after it in its tier, and ``load`` the requests running or
waiting there. A balance guard as in SGLang's router overrides the score: when
``max_load - min_load > balance_abs_threshold`` and ``max_load > balance_rel_threshold *
min_load``, the least loaded replica wins.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from prefixcache.router.index import Overlap
from prefixcache.router.ring import DEFAULT_VNODES, HashRing

DEFAULT_TIER_WEIGHT = 0.5  # a tier block saves less than a pool block: it must be loaded
DEFAULT_LOAD_WEIGHT = 1.0  # blocks of prefill one running or waiting request is worth
DEFAULT_BALANCE_ABS = 16.0  # requests (SGLang: 64 for GPU-sized batches)
DEFAULT_BALANCE_REL = 1.5  # SGLang's default
DEFAULT_PREFIX_BLOCKS = 8  # prefix-hash keys on the digest of the first 8 blocks
COST_EPSILON = 1e-9


class Candidate(NamedTuple):
    """A healthy replica as a policy sees it."""

    url: str
    load: float = 0.0
    overlap: Overlap = Overlap()


class Choice(NamedTuple):
    """Where a request goes, and why (a label for metrics and logs)."""

    url: str
    reason: str
    overlap: Overlap = Overlap()


class RoutingPolicy(ABC):
    """Picks one of the candidates (never empty) for a prompt's digests."""

    name: ClassVar[str]
    uses_digests: ClassVar[bool] = False  # needs the tokenizer and the prompt's digests
    uses_overlap: ClassVar[bool] = False  # needs the index's overlap per candidate

    @abstractmethod
    def choose(self, digests: Sequence[bytes], candidates: Sequence[Candidate]) -> Choice:
        """The replica for this request."""


class _Rotation:
    """Round-robin among tied candidates, so equal replicas share the traffic."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, tied: Sequence[Candidate]) -> Candidate:
        """The next of ``tied`` in turn; a lone candidate does not advance the turn."""
        if len(tied) == 1:
            return tied[0]
        return tied[next(self._counter) % len(tied)]


def least_loaded(candidates: Sequence[Candidate], rotation: _Rotation) -> Candidate:
    """The candidate with the lowest load (ties rotate)."""
    lowest = min(c.load for c in candidates)
    return rotation.pick([c for c in candidates if c.load <= lowest + COST_EPSILON])


class RoundRobin(RoutingPolicy):
    """Each healthy replica in turn, regardless of content or load."""

    name = "round-robin"

    def __init__(self) -> None:
        self._rotation = _Rotation()

    def choose(self, digests: Sequence[bytes], candidates: Sequence[Candidate]) -> Choice:
        assert candidates, "no candidate replica"
        return Choice(self._rotation.pick(candidates).url, "round-robin")


class LeastLoaded(RoutingPolicy):
    """The replica with the fewest requests running or waiting."""

    name = "least-loaded"

    def __init__(self) -> None:
        self._rotation = _Rotation()

    def choose(self, digests: Sequence[bytes], candidates: Sequence[Candidate]) -> Choice:
        assert candidates, "no candidate replica"
        return Choice(least_loaded(candidates, self._rotation).url, "least-loaded")


class PrefixHash(RoutingPolicy):
    """Consistent hashing on the digest of the first ``prefix_blocks`` blocks.

    The digest is chained, so it names all of those blocks (and the tenant's salt). A
    prompt shorter than one block has no digest and goes to the least loaded replica.
    """

    name = "prefix-hash"
    uses_digests = True

    def __init__(
        self, prefix_blocks: int = DEFAULT_PREFIX_BLOCKS, vnodes: int = DEFAULT_VNODES
    ) -> None:
        assert prefix_blocks >= 1
        self.prefix_blocks, self.vnodes = prefix_blocks, vnodes
        self._rings: dict[frozenset[str], HashRing] = {}
        self._rotation = _Rotation()

    def choose(self, digests: Sequence[bytes], candidates: Sequence[Candidate]) -> Choice:
        assert candidates, "no candidate replica"
        if not digests:
            return Choice(least_loaded(candidates, self._rotation).url, "short-prompt")
        key = digests[min(self.prefix_blocks, len(digests)) - 1]
        return Choice(self._ring({c.url for c in candidates}).node_for(key), "hash")

    def _ring(self, urls: set[str]) -> HashRing:
        """One ring per set of healthy replicas (a handful of sets over a cluster's life)."""
        members = frozenset(urls)
        ring = self._rings.get(members)
        if ring is None:
            ring = self._rings[members] = HashRing(members, self.vnodes)
        return ring


@dataclass(frozen=True, slots=True)
class CacheAwareWeights:
    """The knobs of ``cache-aware`` (see the module docstring for the formula)."""

    tier_weight: float = DEFAULT_TIER_WEIGHT
    load_weight: float = DEFAULT_LOAD_WEIGHT
    balance_abs_threshold: float = DEFAULT_BALANCE_ABS
    balance_rel_threshold: float = DEFAULT_BALANCE_REL


class CacheAware(RoutingPolicy):
    """Longest cached prefix against load; the least loaded when load is too uneven."""

    name = "cache-aware"
    uses_digests = True
    uses_overlap = True

    def __init__(self, weights: CacheAwareWeights | None = None) -> None:
        self.weights = weights or CacheAwareWeights()
        self._rotation = _Rotation()

    def cost(self, num_blocks: int, candidate: Candidate) -> float:
        """Blocks left to compute, a tier block counted as partly computed, plus load."""
        w = self.weights
        saved = candidate.overlap.pool_blocks + w.tier_weight * candidate.overlap.tier_blocks
        return num_blocks - saved + w.load_weight * candidate.load

    def imbalanced(self, candidates: Sequence[Candidate]) -> bool:
        """SGLang's guard: both the absolute and the relative load gap are too large."""
        loads = [c.load for c in candidates]
        high, low = max(loads), min(loads)
        w = self.weights
        return high - low > w.balance_abs_threshold and high > w.balance_rel_threshold * low

    def choose(self, digests: Sequence[bytes], candidates: Sequence[Candidate]) -> Choice:
        assert candidates, "no candidate replica"
        if self.imbalanced(candidates):
            chosen = least_loaded(candidates, self._rotation)
            return Choice(chosen.url, "balance", chosen.overlap)
        costs = [self.cost(len(digests), c) for c in candidates]
        best = min(costs)
        tied = [c for c, cost in zip(candidates, costs, strict=True) if cost <= best + COST_EPSILON]
        chosen = least_loaded(tied, self._rotation)
        reason = "cache" if chosen.overlap != Overlap() else "load"
        return Choice(chosen.url, reason, chosen.overlap)


POLICIES: dict[str, type[RoutingPolicy]] = {
    policy.name: policy for policy in (CacheAware, RoundRobin, LeastLoaded, PrefixHash)
}
POLICY_NAMES = tuple(POLICIES)
DEFAULT_POLICY = CacheAware.name


def make_policy(
    name: str,
    weights: CacheAwareWeights | None = None,
    prefix_blocks: int = DEFAULT_PREFIX_BLOCKS,
) -> RoutingPolicy:
    """The policy called ``name``; ValueError lists the choices."""
    if name == CacheAware.name:
        return CacheAware(weights)
    if name == PrefixHash.name:
        return PrefixHash(prefix_blocks)
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {list(POLICY_NAMES)}")
    return POLICIES[name]()
