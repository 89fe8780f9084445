"""Prometheus metrics: what the prefix cache is doing, by tenant. Never any prompt text."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from prefixcache.engine.engine import LLMEngine
from prefixcache.engine.request import RequestOutput
from prefixcache.engine.tier_link import TierLink

TOKEN_BUCKETS = (0, 16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
LOOKUP_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1)


class CacheCollector:
    """Reads the cache's own counters at scrape time (no double bookkeeping)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    def collect(self):
        manager = self.engine.manager
        stats = manager.stats
        counters = [
            (
                "prefix_cache_queries_tokens",
                "Prompt tokens looked up in the prefix cache",
                stats.queries,
            ),
            ("prefix_cache_hits_tokens", "Prompt tokens served from the prefix cache", stats.hits),
            ("kv_evictions", "Cached blocks whose slot was reused", stats.evictions),
            (
                "kv_duplicate_blocks",
                "Committed blocks whose content was already cached",
                stats.duplicate_blocks,
            ),
            ("kv_copy_on_write", "Shared partial blocks copied before an append", stats.cow_copies),
        ]
        for name, documentation, value in counters:
            yield CounterMetricFamily(f"prefixcache_{name}", documentation, value=value)
        gauges = [
            ("kv_usage_ratio", "Share of KV blocks held by live requests", manager.usage),
            ("kv_free_blocks", "KV blocks with refcount 0", manager.num_free_blocks),
            ("kv_free_blocks_low_watermark", "Fewest free KV blocks seen", stats.min_free_blocks),
            ("kv_blocks", "KV blocks in the pool", manager.num_blocks),
            ("requests_running", "Branches running", len(self.engine.scheduler.running)),
            ("requests_waiting", "Branches waiting", len(self.engine.scheduler.waiting)),
        ]
        for name, documentation, value in gauges:
            yield GaugeMetricFamily(f"prefixcache_{name}", documentation, value=value)
        hits = CounterMetricFamily(
            "prefixcache_cached_tokens", "Prompt tokens not computed, by source", labels=["source"]
        )
        hits.add_metric(["pool"], stats.hits)
        hits.add_metric(["tier"], stats.tier_hits)
        yield hits
        if self.engine.tier is not None:
            yield from tier_metrics(self.engine.tier)


TIER_COUNTERS = (
    ("lookups", "Tier lookups (one per request with blocks beyond the pool's hit)"),
    ("hit_blocks", "Blocks found in the tier"),
    ("miss_blocks", "Blocks asked of the tier and not found"),
    ("loads", "Tier fetches that returned blocks"),
    ("load_seconds", "Seconds spent fetching from the tier"),
    ("bytes_read", "Bytes read from the tier"),
    ("writes", "Blocks written to the tier"),
    ("bytes_written", "Bytes written to the tier"),
    ("writes_dropped", "Writes dropped: queue full or tier down"),
    ("errors", "Tier calls that failed"),
    ("evictions", "Blocks the tier evicted (disk tier)"),
)


def tier_metrics(tier: TierLink) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
    """The second tier's counters, rejected values by reason and the breaker's state."""
    stats = tier.client.stats
    labels = {"medium": tier.client.medium}
    for name, documentation in TIER_COUNTERS:
        family = CounterMetricFamily(f"prefixcache_tier_{name}", documentation, labels=["medium"])
        family.add_metric([labels["medium"]], getattr(stats, name))
        yield family
    rejected = CounterMetricFamily(
        "prefixcache_tier_rejected_values",
        "Tier values that failed a check (checksum, digest, layout, ...): misses, never loaded",
        labels=["medium", "reason"],
    )
    for reason, count in sorted(stats.rejected.items()):
        rejected.add_metric([labels["medium"], reason], count)
    yield rejected
    timeouts = CounterMetricFamily(
        "prefixcache_tier_fetch_timeouts", "Fetches given up at their deadline", labels=["medium"]
    )
    timeouts.add_metric([labels["medium"]], tier.timeouts)
    yield timeouts
    state = GaugeMetricFamily(
        "prefixcache_tier_breaker_state",
        "Circuit breaker: 1 for the current state",
        labels=["medium", "state"],
    )
    current = tier.client.breaker_state
    for name in ("closed", "open", "half_open"):
        state.add_metric([labels["medium"], name], 1.0 if name == current else 0.0)
    yield state


class ServerMetrics:
    """Per-request observations plus the cache collector, on a private registry."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.registry = CollectorRegistry()
        self.registry.register(CacheCollector(engine))
        self._recent_first_blocks: OrderedDict[str, deque] = OrderedDict()
        metric = {"registry": self.registry, "namespace": "prefixcache"}
        self.requests = Counter(
            "requests", "Finished HTTP requests", ["tenant", "endpoint", "status"], **metric
        )
        self.ttft = Histogram(
            "ttft_seconds",
            "Time to first token",
            ["tenant", "cache"],
            buckets=SECONDS_BUCKETS,
            **metric,
        )
        self.reusable = Histogram(
            "reusable_tokens_per_request", "Prompt tokens reused", buckets=TOKEN_BUCKETS, **metric
        )
        self.first_miss = Histogram(
            "first_miss_position_tokens",
            "Position of the first prompt token not served from cache",
            buckets=TOKEN_BUCKETS,
            **metric,
        )
        self.prefill_tokens = Counter("prefill_tokens_computed", "Prompt tokens computed", **metric)
        self.saved_tokens = Counter(
            "prefill_tokens_saved", "Prompt tokens not recomputed", **metric
        )
        self.saved_seconds = Counter(
            "prefill_seconds_saved",
            "Estimated prefill time saved (saved tokens x measured seconds per token)",
            **metric,
        )
        self.lookup = Histogram(
            "cache_lookup_seconds",
            "Admission lookup time per request",
            buckets=LOOKUP_BUCKETS,
            **metric,
        )
        self.short_prefix = Counter(
            "shared_prefix_below_one_block",
            "Requests with no hit whose prompt shares 1..block_size-1 leading tokens with a "
            "recent request of the same salt: the prefix is shorter than one block",
            **metric,
        )

    def observe(self, tenant: str, output: RequestOutput, salt: str) -> None:
        """Record one finished request (token counts and timings only)."""
        cached = output.num_cached_tokens
        metrics = output.metrics
        if metrics.ttft is not None:
            source = "tier" if output.num_tier_tokens else "hit" if cached else "miss"
            self.ttft.labels(tenant, source).observe(metrics.ttft)
        self.reusable.observe(cached)
        self.first_miss.observe(cached)
        self.prefill_tokens.inc(metrics.num_prefill_tokens)
        self.saved_tokens.inc(cached)
        if self.engine.seconds_per_token is not None:
            self.saved_seconds.inc(cached * self.engine.seconds_per_token)
        self.lookup.observe(metrics.lookup_seconds)
        self._check_short_prefix(output.prompt_token_ids, cached, salt)

    def _check_short_prefix(self, prompt: list[int], cached: int, salt: str) -> None:
        """Count a miss that shares a sub-block prefix with recent traffic of its salt."""
        block_size = self.engine.config.block_size
        head = tuple(prompt[:block_size])
        recent = self._recent_first_blocks.setdefault(salt, deque(maxlen=64))
        self._recent_first_blocks.move_to_end(salt)
        if len(self._recent_first_blocks) > 256:
            self._recent_first_blocks.popitem(last=False)
        if cached == 0 and any(0 < _common(head, other) < block_size for other in recent):
            self.short_prefix.inc()
        recent.append(head)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _common(left: tuple[int, ...], right: tuple[int, ...]) -> int:
    """Length of the common prefix of two token tuples."""
    count = 0
    for a, b in zip(left, right, strict=False):
        if a != b:
            break
        count += 1
    return count
