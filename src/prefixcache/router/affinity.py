"""Key affinity: requests with one ``prompt_cache_key`` (per tenant) stay on one replica.

A key's first request goes where the policy sends it; later ones go back to that replica
while it is a candidate (healthy, not already tried) and not overloaded by the balance
guard's load rule (``overloaded``); otherwise the policy chooses again and the key follows.
Keys are opaque bytes (the router passes a digest of tenant and key, never the raw key), kept
in an LRU of ``max_keys``. Pure: no I/O, no clock, shared by the router and the simulator.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

from prefixcache.router.policy import (
    COST_EPSILON,
    CacheAware,
    CacheAwareWeights,
    Candidate,
    Choice,
    RoutingPolicy,
)

DEFAULT_MAX_KEYS = 100_000  # keys remembered (about 100 bytes each)
AFFINITY_REASON = "affinity"


class Affine(NamedTuple):
    """A choice and what affinity did: "kept" (sent to the key's replica), "first" (a key
    not remembered), "moved" (its replica was overloaded or gone), or None (no key)."""

    choice: Choice
    outcome: str | None


def key_digest(tenant: str, key: str) -> bytes:
    """An opaque id for ``key`` of ``tenant``: the raw key is never kept or logged."""
    data = f"{len(tenant)}:{tenant}{key}".encode()
    return hashlib.blake2b(data, digest_size=16, person=b"prefixcache-key").digest()


def overloaded(candidate: Candidate, candidates: Sequence[Candidate], w: CacheAwareWeights) -> bool:
    """The balance guard's rule, for one replica: too far above the least loaded one."""
    low = min(c.load for c in candidates)
    over_abs = candidate.load - low > w.balance_abs_threshold + COST_EPSILON
    return over_abs and candidate.load > w.balance_rel_threshold * low


class KeyAffinity:
    """Key -> replica URL, LRU-bounded, over any routing policy."""

    def __init__(
        self, max_keys: int = DEFAULT_MAX_KEYS, weights: CacheAwareWeights | None = None
    ) -> None:
        assert max_keys >= 1
        self.max_keys = max_keys
        self.weights = weights or CacheAwareWeights()
        self._replica: OrderedDict[bytes, str] = OrderedDict()

    @classmethod
    def for_policy(cls, policy: RoutingPolicy, max_keys: int = DEFAULT_MAX_KEYS) -> KeyAffinity:
        """Affinity with the policy's own load rule (cache-aware's weights; else defaults)."""
        weights = policy.weights if isinstance(policy, CacheAware) else None
        return cls(max_keys, weights)

    def __len__(self) -> int:
        return len(self._replica)

    def choose(
        self,
        key: bytes | None,
        policy: RoutingPolicy,
        digests: Sequence[bytes],
        candidates: Sequence[Candidate],
    ) -> Affine:
        """The key's replica if it may take the request, else the policy's choice (remembered)."""
        if key is None:
            return Affine(policy.choose(digests, candidates), None)
        url = self._replica.get(key)
        sticky = next((c for c in candidates if c.url == url), None) if url else None
        if sticky is not None and not overloaded(sticky, candidates, self.weights):
            self._replica.move_to_end(key)
            return Affine(Choice(sticky.url, AFFINITY_REASON, sticky.overlap), "kept")
        choice = policy.choose(digests, candidates)
        self._remember(key, choice.url)
        return Affine(choice, "first" if url is None else "moved")

    def _remember(self, key: bytes, url: str) -> None:
        self._replica[key] = url
        self._replica.move_to_end(key)
        while len(self._replica) > self.max_keys:
            self._replica.popitem(last=False)
