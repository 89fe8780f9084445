"""Cluster simulation: a trace through N real caches behind the router's own policies.

Each replica is a ``KVCacheManager`` of the given capacity; requests arrive in timestamp
order and a routing policy from ``prefixcache.router.policy`` (the code the router runs)
picks a replica from each one's longest cached prefix (``match``, exact, as a router fed by
every event would know it) and its load. Load comes from a simple service-time model: a
request keeps its replica busy for ``fixed + computed prompt tokens x prefill +
output tokens x decode`` seconds, and a replica's load is the requests it is serving. A
shared tier (``shared_tier`` blocks, one more cache that every request also goes through)
credits the blocks after a replica's own hit at ``tier_weight``, as the router does.

``key-affinity`` is what the router does with a ``prompt_cache_key``: cache-aware, through
the router's own ``KeyAffinity`` on each request's ``cache_key`` (requests without one are
routed by cache-aware alone).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from prefixcache.cache import KVCacheManager
from prefixcache.cache.common import DEFAULT_BLOCK_SIZE
from prefixcache.router.affinity import KeyAffinity
from prefixcache.router.index import Overlap
from prefixcache.router.policy import POLICY_NAMES, CacheAware, Candidate, make_policy
from prefixcache.shutdown import raise_if_stop_requested
from prefixcache.sim.replay import check_capacity, replay
from prefixcache.sim.traces import MooncakeRequest, TokenRequest, Trace

KEY_AFFINITY = "key-affinity"
CLUSTER_POLICY_NAMES = (*POLICY_NAMES, KEY_AFFINITY)


class _Routing:
    """A router's decision: one of its policies, or cache-aware behind key affinity."""

    def __init__(self, name: str) -> None:
        self.affinity: KeyAffinity | None = None
        if name == KEY_AFFINITY:
            self.policy = make_policy(CacheAware.name)
            self.affinity = KeyAffinity.for_policy(self.policy)
        else:
            self.policy = make_policy(name)
        self.kept = 0  # requests affinity sent to their key's replica

    def choose(
        self,
        request: MooncakeRequest | TokenRequest,
        digests: Sequence[bytes],
        candidates: Sequence[Candidate],
    ) -> str:
        """The chosen replica's URL."""
        if self.affinity is None:
            return self.policy.choose(digests, candidates).url
        key = None if request.cache_key is None else request.cache_key.to_bytes(8, "big")
        choice, outcome = self.affinity.choose(key, self.policy, digests, candidates)
        self.kept += outcome == "kept"
        return choice.url


@dataclass(frozen=True, slots=True)
class ServiceModel:
    """How long one request keeps its replica busy (seconds)."""

    fixed: float = 0.02
    prefill_per_token: float = 2e-4
    decode_per_token: float = 2e-2

    def seconds(self, computed_tokens: int, output_tokens: int) -> float:
        return (
            self.fixed
            + computed_tokens * self.prefill_per_token
            + output_tokens * self.decode_per_token
        )


@dataclass(slots=True)
class ClusterResult:
    """One routing policy over N replicas: hit rates and how evenly the load spread."""

    policy: str
    replicas: int
    capacity: int  # blocks per replica
    blocks: int = 0
    hit_blocks: int = 0  # from the chosen replica's pool
    tier_blocks: int = 0  # from the shared tier, after the pool's hit
    ideal_hit_rate: float = 0.0  # one cache of replicas x capacity blocks
    affinity_kept: int = 0  # key-affinity: requests sent to their key's replica
    per_replica: list[int] = field(default_factory=list)  # requests routed to each

    @property
    def hit_rate(self) -> float:
        """Blocks not computed (pool and tier) over blocks looked up."""
        return (self.hit_blocks + self.tier_blocks) / self.blocks if self.blocks else 0.0

    @property
    def imbalance(self) -> float:
        """Requests on the busiest replica over the mean (1.0 is perfectly even)."""
        mean = sum(self.per_replica) / len(self.per_replica)
        return max(self.per_replica) / mean if mean else 1.0


class _Replica:
    """One simulated replica: its cache and the finish times of what it is serving."""

    def __init__(self, url: str, capacity: int, block_size: int) -> None:
        self.url = url
        self.manager = KVCacheManager(capacity, block_size)
        self.busy_until: list[float] = []

    def load(self, now: float) -> int:
        """Requests still being served at ``now``."""
        while self.busy_until and self.busy_until[0] <= now:
            heapq.heappop(self.busy_until)
        return len(self.busy_until)


def simulate_cluster(
    trace: Trace,
    replicas: int,
    capacity: int,
    policy: str,
    *,
    shared_tier: int = 0,
    block_size: int = DEFAULT_BLOCK_SIZE,
    service: ServiceModel | None = None,
) -> ClusterResult:
    """Route every request of ``trace`` (timestamp order) over ``replicas`` caches."""
    check_capacity(trace, capacity, block_size)
    size = 1 if trace.kind == "mooncake" else block_size
    nodes = [_Replica(f"replica-{i}", capacity, size) for i in range(replicas)]
    tier = KVCacheManager(shared_tier, size) if shared_tier else None
    router = _Routing(policy)
    result = ClusterResult(policy, replicas, capacity, per_replica=[0] * replicas)
    ordered = sorted(enumerate(trace.requests), key=lambda item: item[1].timestamp)
    for number, request in ordered:
        if number % 256 == 255:
            raise_if_stop_requested()  # see replay(): a dropped Ctrl-C still ends the run
        _route_one(str(number), request, nodes, tier, router, result, service or ServiceModel())
    ideal = replay(trace, capacity * replicas, block_size=block_size)
    result.ideal_hit_rate = ideal.block_hit_rate
    result.affinity_kept = router.kept
    return result


def _route_one(
    request_id: str,
    request: MooncakeRequest | TokenRequest,
    nodes: Sequence[_Replica],
    tier: KVCacheManager | None,
    router: _Routing,
    result: ClusterResult,
    service: ServiceModel,
) -> None:
    """Pick a replica, serve the request through its cache (and the tier), count."""
    ids, salt, cap = _lookup_key(request)
    now = request.timestamp / 1000  # milliseconds in both trace formats
    tier_match = _blocks(tier, ids, salt, cap) if tier is not None else 0
    candidates = []
    for node in nodes:
        pool = _blocks(node.manager, ids, salt, cap)
        overlap = Overlap(pool, max(0, tier_match - pool))
        candidates.append(Candidate(node.url, float(node.load(now)), overlap))
    digests = [str(i).encode() for i in ids] if router.policy.uses_digests else []
    url = router.choose(request, digests, candidates)
    chosen = next(node for node in nodes if node.url == url)
    pool_hit = _serve(chosen.manager, request_id, ids, salt, cap)
    if tier is not None:
        _serve(tier, request_id, ids, salt, cap)
    blocks = len(ids) if cap is False else len(ids) // chosen.manager.block_size
    tier_hit = max(0, min(tier_match, blocks) - pool_hit)
    result.blocks += blocks
    result.hit_blocks += pool_hit
    result.tier_blocks += tier_hit
    result.per_replica[nodes.index(chosen)] += 1
    computed = _computed_tokens(request, pool_hit + tier_hit, chosen.manager.block_size)
    heapq.heappush(chosen.busy_until, now + service.seconds(computed, _outputs(request)))


def _lookup_key(request: MooncakeRequest | TokenRequest) -> tuple[list[int], str | None, bool]:
    """Token ids to look up, the salt, and whether rule 10's cap applies."""
    if isinstance(request, MooncakeRequest):
        return request.hash_ids, None, False
    return request.token_ids, request.cache_salt, True


def _blocks(manager: KVCacheManager, ids: list[int], salt: str | None, cap: bool) -> int:
    """Leading blocks of ``ids`` the cache holds right now."""
    return manager.match(ids, salt, cap_last_token=cap) // manager.block_size


def _serve(manager: KVCacheManager, request_id: str, ids: list[int], salt, cap: bool) -> int:
    """Admit, compute (commit) and free one request; the blocks it hit."""
    seq = manager.admit(request_id, ids, salt, cap_last_token=cap)
    assert seq is not None, "a sequential replay always has the whole pool free"
    manager.commit(seq, len(ids))
    manager.free(seq)
    return seq.num_cached_tokens // manager.block_size


def _computed_tokens(request: MooncakeRequest | TokenRequest, hit: int, block_size: int) -> int:
    """Prompt tokens the replica computes after its hit."""
    if isinstance(request, MooncakeRequest):
        return request.input_length - request.hit_tokens(hit)
    return max(0, len(request.token_ids) - hit * block_size)


def _outputs(request: MooncakeRequest | TokenRequest) -> int:
    if isinstance(request, MooncakeRequest):
        return request.output_length
    return len(request.output_token_ids)
