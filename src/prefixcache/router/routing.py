"""One routing decision: candidates from the fleet and the index, the policy's choice, accounting.

``dispatch`` counts the request as in flight on the chosen replica (the load the next
decision sees at once) and, for ``cache-aware``, credits the replica with the prompt's
blocks until its events confirm them; ``release`` undoes both when the request ends. A
request with a key (a digest of its tenant and ``prompt_cache_key``) goes through the key
affinity (``router/affinity.py``) first. A request ``pinned`` to a replica (one naming a
``previous_response_id`` that replica issued) goes there while it is a candidate.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from prefixcache.router.affinity import KeyAffinity
from prefixcache.router.index import Expectation, GlobalIndex, Overlap
from prefixcache.router.metrics import RouterMetrics
from prefixcache.router.policy import Candidate, Choice, RoutingPolicy
from prefixcache.router.replicas import Fleet, Replica

PINNED_REASON = "previous_response"  # the replica that stored the conversation
DEFAULT_EXPECT_GRACE_S = 2.0  # how long a finished request's blocks stay credited without events


@dataclass(slots=True, eq=False)
class Ticket:
    """A request placed on a replica; ``Router.release`` it exactly once."""

    replica: Replica
    choice: Choice
    expectation: Expectation | None
    released: bool = False

    @property
    def url(self) -> str:
        return self.replica.url


class Router:
    """Fleet + index + policy."""

    def __init__(
        self,
        fleet: Fleet,
        index: GlobalIndex,
        policy: RoutingPolicy,
        metrics: RouterMetrics,
        expect_grace_s: float = DEFAULT_EXPECT_GRACE_S,
        affinity: KeyAffinity | None = None,
    ) -> None:
        self.fleet, self.index, self.policy, self.metrics = fleet, index, policy, metrics
        self.expect_grace_s = expect_grace_s
        self.affinity = affinity  # None: keys are ignored

    def candidates(
        self, digests: Sequence[bytes], exclude: Collection[str] = ()
    ) -> list[Candidate]:
        """Every healthy replica not in ``exclude``, with its load (and overlap if used)."""
        use_overlap = self.policy.uses_overlap and bool(digests)
        return [
            Candidate(
                r.url, r.load, self.index.overlap(r.url, digests) if use_overlap else Overlap()
            )
            for r in self.fleet.healthy()
            if r.url not in exclude
        ]

    def dispatch(
        self,
        digests: Sequence[bytes],
        exclude: Collection[str] = (),
        key: bytes | None = None,
        pinned: str | None = None,
    ) -> Ticket | None:
        """Choose a replica and count the request on it; None if no replica is left.
        ``pinned``: a replica URL the request must go to while it is a candidate."""
        candidates = self.candidates(digests, exclude)
        if not candidates:
            return None
        pin = next((c for c in candidates if c.url == pinned), None) if pinned else None
        if pin is not None:
            choice = Choice(pin.url, PINNED_REASON, pin.overlap)
        else:
            choice = self._choose(digests, candidates, key)
        replica = self.fleet.replicas[choice.url]
        replica.in_flight += 1
        expectation = self.index.expect(choice.url, digests) if self.policy.uses_overlap else None
        self._count(choice, len(digests))
        return Ticket(replica, choice, expectation)

    def _choose(
        self, digests: Sequence[bytes], candidates: list[Candidate], key: bytes | None
    ) -> Choice:
        """The policy's choice, through the key affinity when the request has a key."""
        if key is None or self.affinity is None:
            return self.policy.choose(digests, candidates)
        choice, outcome = self.affinity.choose(key, self.policy, digests, candidates)
        self.metrics.affinity.labels(outcome).inc()
        return choice

    def release(self, ticket: Ticket, ok: bool) -> None:
        """The request ended: no longer in flight; its expectation fades (at once if it failed)."""
        if ticket.released:
            return
        ticket.released = True
        ticket.replica.in_flight -= 1
        self.index.settle(ticket.expectation, self.expect_grace_s if ok else 0.0)

    def _count(self, choice: Choice, num_blocks: int) -> None:
        self.metrics.decisions.labels(self.policy.name, choice.reason).inc()
        if not self.policy.uses_overlap:
            return  # the policy does not look at the index: nothing was expected anywhere
        pool, tier = choice.overlap
        self.metrics.routed_blocks.labels("pool").inc(pool)
        self.metrics.routed_blocks.labels("tier").inc(tier)
        self.metrics.routed_blocks.labels("miss").inc(max(0, num_blocks - pool - tier))
