"""The router's own Prometheus metrics (labels: replica URLs, policies, reasons; never text)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from prefixcache.router.replicas import Fleet


class FleetCollector:
    """Per-replica state read at scrape time: membership, load, index size, event feed."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def collect(self) -> Iterator[Metric]:
        healthy = GaugeMetricFamily(
            "prefixcache_router_replica_healthy", "1 while in the rotation", labels=["replica"]
        )
        in_flight = GaugeMetricFamily(
            "prefixcache_router_in_flight", "Requests open on a replica", labels=["replica"]
        )
        load = GaugeMetricFamily(
            "prefixcache_router_replica_load", "Running + waiting, as routed on", labels=["replica"]
        )
        blocks = GaugeMetricFamily(
            "prefixcache_router_index_blocks",
            "Digests the index credits to a replica",
            labels=["replica", "kind"],
        )
        batches = CounterMetricFamily(
            "prefixcache_router_event_batches", "KV event batches applied", labels=["replica"]
        )
        lost = CounterMetricFamily(
            "prefixcache_router_event_batches_lost", "KV event batches missed", labels=["replica"]
        )
        for replica in self.fleet.replicas.values():
            url = replica.url
            healthy.add_metric([url], float(replica.healthy))
            in_flight.add_metric([url], replica.in_flight)
            load.add_metric([url], replica.load)
            counts = self.fleet.index.counts(url)
            for kind in ("pool", "tier", "expected"):
                blocks.add_metric([url, kind], getattr(counts, kind))
            if replica.feed is not None:
                batches.add_metric([url], replica.feed.stats.batches)
                lost.add_metric([url], replica.feed.stats.lost)
        yield from (healthy, in_flight, load, blocks, batches, lost)


class RouterMetrics:
    """Counters the request path updates, plus the fleet's gauges."""

    def __init__(self, fleet: Fleet) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "prefixcache_router_requests",
            "Requests answered, by replica and status",
            ["replica", "endpoint", "status"],
            registry=self.registry,
        )
        self.retries = Counter(
            "prefixcache_router_retries",
            "Requests sent again to another replica before any byte reached the client",
            ["reason"],
            registry=self.registry,
        )
        self.decisions = Counter(
            "prefixcache_router_decisions",
            "Routing decisions, by policy and reason",
            ["policy", "reason"],
            registry=self.registry,
        )
        self.routed_blocks = Counter(
            "prefixcache_router_routed_blocks",
            "Prompt blocks routed, by where the index expected them: pool, tier or miss",
            ["source"],
            registry=self.registry,
        )
        self.affinity = Counter(
            "prefixcache_router_key_affinity",
            "Requests with a prompt_cache_key: kept on the key's replica (affinity-routed), "
            "first of their key, or moved (the replica was overloaded or unavailable)",
            ["outcome"],
            registry=self.registry,
        )
        self.aborted_reads = Counter(
            "prefixcache_router_aborted_reads",
            "Requests whose client left before its body arrived (never forwarded)",
            registry=self.registry,
        )
        self.registry.register(FleetCollector(fleet))

    def render(self) -> bytes:
        return generate_latest(self.registry)
