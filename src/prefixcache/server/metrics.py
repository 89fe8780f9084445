"""Prometheus metrics: what the prefix cache is doing, by tenant. Never any prompt text."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol
from wsgiref.simple_server import WSGIRequestHandler

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from prefixcache.cache.owners import OwnerUsage
from prefixcache.engine.request import RequestOutput
from prefixcache.engine.snapshot import EngineSnapshot, TierSnapshot, WindowCounters

TOKEN_BUCKETS = (0, 16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
LOOKUP_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1)
VLLM_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
VLLM_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
VLLM_TPOT_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
VLLM_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)


class SnapshotSource(Protocol):
    """What the metrics read: the engine's numbers as last published (an ``LLMEngine``,
    whose ``AsyncLLMEngine`` thread publishes them)."""

    snapshot: EngineSnapshot


class CacheCollector:
    """The cache's own counters at scrape time, from the engine's published snapshot only
    (no double bookkeeping, and no reads of state the engine thread is changing)."""

    def __init__(self, source: SnapshotSource, model_name: str = "") -> None:
        self.source = source
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        snapshot = self.source.snapshot  # one snapshot for the whole scrape
        yield from cache_metrics(snapshot)
        yield from vllm_gauges(snapshot, self.model_name)


def cache_metrics(snapshot: EngineSnapshot) -> Iterator[Metric]:
    """Our cache counters and gauges, per-tenant usage and the tier's numbers."""
    counters = [
        (
            "prefix_cache_queries_tokens",
            "Prompt tokens looked up in the prefix cache",
            snapshot.queries,
        ),
        ("prefix_cache_hits_tokens", "Prompt tokens served from the prefix cache", snapshot.hits),
        ("kv_evictions", "Cached blocks whose slot was reused", snapshot.evictions),
        (
            "kv_duplicate_blocks",
            "Committed blocks whose content was already cached",
            snapshot.duplicate_blocks,
        ),
        ("kv_copy_on_write", "Shared partial blocks copied before an append", snapshot.cow_copies),
        (
            "fair_admission_deferrals",
            "Admissions put off so as not to evict another tenant's blocks within its share",
            snapshot.num_fair_deferrals,
        ),
    ]
    for name, documentation, value in counters:
        yield CounterMetricFamily(f"prefixcache_{name}", documentation, value=value)
    gauges = [
        ("kv_usage_ratio", "Share of KV blocks held by live requests", snapshot.usage),
        ("kv_free_blocks", "KV blocks with refcount 0", snapshot.num_free_blocks),
        ("kv_free_blocks_low_watermark", "Fewest free KV blocks seen", snapshot.min_free_blocks),
        ("kv_blocks", "KV blocks in the pool", snapshot.num_blocks),
        ("requests_running", "Branches running", snapshot.num_running),
        ("requests_waiting", "Branches waiting", snapshot.num_waiting),
        (
            "prefill_tokens_pending",
            "Prompt tokens still to compute: running prefills' rest and waiting requests' "
            "past their prefix hit (a router weighs replicas by it)",
            snapshot.num_prefill_tokens_pending,
        ),
    ]
    for name, documentation, value in gauges:
        yield GaugeMetricFamily(f"prefixcache_{name}", documentation, value=value)
    yield by_label(
        GaugeMetricFamily,
        "kv_blocks_by_state",
        "KV blocks by state: running (held by live requests), cached (free, evictable, holding "
        "a prefix), retained (free, kept by a retention mark), free (holding nothing)",
        "state",
        snapshot.pool_states,
    )
    yield by_label(
        GaugeMetricFamily,
        "kv_bytes_per_token",
        "Bytes one cached token takes in the KV pool: all layers, K and V, int8 scales "
        "included; by the pool's KV dtype",
        "dtype",
        [(snapshot.kv_cache_dtype, snapshot.kv_bytes_per_token)],
    )
    yield by_label(
        CounterMetricFamily,
        "cached_tokens",
        "Prompt tokens not computed, by source",
        "source",
        [("pool", snapshot.hits), ("tier", snapshot.tier_hits)],
    )
    yield from owner_metrics(snapshot.owners)
    if snapshot.windows is not None:
        yield from window_metrics(snapshot.windows)
    yield from step_metrics(snapshot)
    yield from retention_metrics(snapshot)
    if snapshot.tier is not None:
        yield from tier_metrics(snapshot.tier)


def window_metrics(windows: WindowCounters) -> Iterator[Metric]:
    """A hybrid layout's window groups: pages given back and evicted, hits they lost, and
    the bytes each group takes per cached token."""
    for name, documentation, value in (
        (
            "kv_window_pages_released",
            "Window pages given back, still cached",
            windows.pages_released,
        ),
        ("kv_window_pages_evicted", "Free window pages reused (block kept)", windows.pages_evicted),
        (
            "kv_window_lost_tokens",
            "Prompt tokens the full layers held but the window layers did not (recomputed)",
            windows.lost_tokens,
        ),
    ):
        yield CounterMetricFamily(f"prefixcache_{name}", documentation, value=value)
    yield by_label(
        GaugeMetricFamily,
        "kv_bytes_per_cached_token",
        "KV bytes per cached token, by group: the full layers' page, each window group's pages "
        "over every cached token (they keep only their window)",
        "group",
        windows.bytes_per_cached_token,
    )


DEFAULT_OWNER_LABEL = "default"  # requests that named no tenant (library use)


def step_metrics(snapshot: EngineSnapshot) -> Iterator[Metric]:
    """Measured step times against the target, and prefills paused, by cause."""
    yield HistogramMetricFamily(
        "prefixcache_step_seconds",
        "Seconds of each engine step's forward",
        buckets=list(snapshot.step_seconds),
        sum_value=snapshot.step_seconds_sum,
    )
    if snapshot.step_target is not None:
        yield GaugeMetricFamily(
            "prefixcache_step_target_seconds",
            "The step time target while others wait or stream (--step-target-ms)",
            value=snapshot.step_target,
        )
    yield by_label(
        CounterMetricFamily,
        "prefill_pauses",
        "Running prefills paused, by cause",
        "cause",
        [("priority", snapshot.num_pauses)],
    )
    yield by_label(
        CounterMetricFamily,
        "interleaved_steps",
        "Long prompts' own steps, and urgent steps run between their layers",
        "kind",
        [("long", snapshot.num_long_steps), ("urgent", snapshot.num_urgent_steps)],
    )
    yield by_label(
        CounterMetricFamily,
        "queue_seconds",
        "Seconds branches waited for admission (steps x branches waiting), by reason",
        "reason",
        snapshot.queue_seconds,
    )


def by_label(
    kind: type[GaugeMetricFamily] | type[CounterMetricFamily],
    name: str,
    documentation: str,
    label: str,
    values: Iterable[tuple[str, float]],
) -> Metric:
    """``prefixcache_<name>`` with one sample per (label value, value)."""
    family = kind(f"prefixcache_{name}", documentation, labels=[label])
    for label_value, value in values:
        family.add_metric([label_value], value)
    return family


def owner_metrics(
    usage: Sequence[OwnerUsage],
) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
    """Per tenant, with ``--fair-cache``: share, cached blocks, evictions suffered and caused."""
    if not usage:
        return
    families = [
        (GaugeMetricFamily, "tenant_cache_share", "Tenant's share of the cached pool", "share"),
        (
            GaugeMetricFamily,
            "tenant_cached_blocks",
            "Free cached KV blocks charged to the tenant (the last user of each)",
            "cached_blocks",
        ),
        (
            CounterMetricFamily,
            "tenant_evictions_suffered",
            "Tenant's cached blocks evicted to make room",
            "evictions_suffered",
        ),
        (
            CounterMetricFamily,
            "tenant_evictions_caused",
            "Cached blocks evicted to make room for the tenant's requests",
            "evictions_caused",
        ),
    ]
    for kind, name, documentation, field in families:
        family = kind(f"prefixcache_{name}", documentation, labels=["tenant"])
        for owner in usage:
            family.add_metric([owner.name or DEFAULT_OWNER_LABEL], getattr(owner, field))
        yield family


RETENTION_COUNTERS = (
    ("saved_hits", "Hits on free blocks kept by retention (prompt_cache_retention)"),
    ("expired", "Retention marks that ran out"),
    ("evictions", "Retained blocks evicted before their expiry: nothing else was free"),
    ("refused", "Blocks a retention ask left unmarked: the tenant's retention budget was full"),
)


def retention_metrics(snapshot: EngineSnapshot) -> Iterator[Metric]:
    """Blocks retained now by tenant and class, and the retention counters."""
    retained = GaugeMetricFamily(
        "prefixcache_retained_blocks",
        "KV blocks retained now (held or free) by tenant and retention class",
        labels=["tenant", "class"],
    )
    for owner, klass, count in snapshot.retained:
        retained.add_metric([owner or DEFAULT_OWNER_LABEL, klass], count)
    yield retained
    for name, documentation in RETENTION_COUNTERS:
        value = getattr(snapshot.retention, name)
        yield CounterMetricFamily(f"prefixcache_retention_{name}", documentation, value=value)


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


def vllm_gauges(snapshot: EngineSnapshot, model_name: str) -> Iterator[Metric]:
    """The engine's state under vLLM's names, for tools built for vLLM (llm-d, dashboards)."""
    families = [
        (GaugeMetricFamily, "num_requests_running", "Requests running", snapshot.num_running),
        (GaugeMetricFamily, "num_requests_waiting", "Requests waiting", snapshot.num_waiting),
        (GaugeMetricFamily, "kv_cache_usage_perc", "KV cache usage (1 = full)", snapshot.usage),
        (CounterMetricFamily, "prefix_cache_queries", "Prompt tokens looked up", snapshot.queries),
        (CounterMetricFamily, "prefix_cache_hits", "Prompt tokens hit", snapshot.hits),
        (CounterMetricFamily, "num_preemptions", "Preemptions", snapshot.num_preemptions),
    ]
    for kind, name, documentation, value in families:
        family = kind(f"vllm:{name}", documentation, labels=["model_name"])
        family.add_metric([model_name], value)
        yield family
    info = GaugeMetricFamily(
        "vllm:cache_config_info",
        "KV cache configuration",
        labels=["block_size", "num_gpu_blocks", "enable_prefix_caching"],
    )
    info.add_metric(
        [
            str(snapshot.block_size),
            str(snapshot.num_blocks),
            str(snapshot.enable_prefix_caching),
        ],
        1.0,
    )
    yield info


def tier_metrics(tier: TierSnapshot) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
    """The second tier's counters, rejected values by reason and the breaker's state."""
    medium = tier.medium
    for name, documentation in TIER_COUNTERS:
        family = CounterMetricFamily(f"prefixcache_tier_{name}", documentation, labels=["medium"])
        family.add_metric([medium], tier.counter(name))
        yield family
    rejected = CounterMetricFamily(
        "prefixcache_tier_rejected_values",
        "Tier values that failed a check (checksum, digest, layout, ...): misses, never loaded",
        labels=["medium", "reason"],
    )
    for reason, count in tier.rejected:
        rejected.add_metric([medium, reason], count)
    yield rejected
    files = CounterMetricFamily(
        "prefixcache_tier_rejected_files",
        "Entries in the tier's store refused before reading (symlink, not a regular file, "
        "another owner, wrong size, ...): misses, their names removed",
        labels=["medium", "reason"],
    )
    for reason, count in tier.rejected_files:
        files.add_metric([medium, reason], count)
    yield files
    timeouts = CounterMetricFamily(
        "prefixcache_tier_fetch_timeouts", "Fetches given up at their deadline", labels=["medium"]
    )
    timeouts.add_metric([medium], tier.timeouts)
    yield timeouts
    state = GaugeMetricFamily(
        "prefixcache_tier_breaker_state",
        "Circuit breaker: 1 for the current state",
        labels=["medium", "state"],
    )
    for name in ("closed", "open", "half_open"):
        state.add_metric([medium, name], 1.0 if name == tier.breaker_state else 0.0)
    yield state


class ServerMetrics:
    """Per-request observations plus the cache collector, on a private registry."""

    def __init__(self, source: SnapshotSource, model_name: str = "") -> None:
        self.source = source  # read only its published snapshot, from any thread
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(CacheCollector(source, model_name))
        self.vllm = VllmRequestMetrics(self.registry, model_name)
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
        seconds_per_token = self.source.snapshot.seconds_per_token
        if seconds_per_token is not None:
            self.saved_seconds.inc(cached * seconds_per_token)
        self.lookup.observe(metrics.lookup_seconds)
        self._check_short_prefix(output.prompt_token_ids, cached, salt)
        self.vllm.observe(output)

    def _check_short_prefix(self, prompt: list[int], cached: int, salt: str) -> None:
        """Count a miss that shares a sub-block prefix with recent traffic of its salt."""
        block_size = self.source.snapshot.block_size
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


def metrics_wsgi_app(metrics: ServerMetrics) -> Callable[..., Iterable[bytes]]:
    """A WSGI app answering ``metrics`` in the text format on every path, whatever the
    scraper accepts. prometheus_client's own app answers a Prometheus (which asks for
    OpenMetrics first) with sample names escaped to underscores, colons included, under
    HELP and TYPE lines that keep them: ``vllm:prompt_tokens_total`` arrived as
    ``vllm_prompt_tokens_total`` (prometheus/client_python issue 1177)."""

    def app(environ: dict, start_response: Callable) -> Iterable[bytes]:
        body = metrics.render()
        headers = [("Content-Type", CONTENT_TYPE_PLAIN_0_0_4), ("Content-Length", str(len(body)))]
        start_response("200 OK", headers)
        return [b""] if environ.get("REQUEST_METHOD") == "HEAD" else [body]

    return app


class QuietHandler(WSGIRequestHandler):
    """Scrapes leave no line on stderr (every few seconds, for ever)."""

    def log_message(self, format: str, *args: object) -> None:
        pass


def _common(left: tuple[int, ...], right: tuple[int, ...]) -> int:
    """Length of the common prefix of two token tuples."""
    count = 0
    for a, b in zip(left, right, strict=False):
        if a != b:
            break
        count += 1
    return count


class VllmRequestMetrics:
    """Per-request histograms and counters under vLLM's names (label ``model_name``)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        common = {"labelnames": ["model_name"], "registry": registry}

        def histogram(name: str, documentation: str, buckets: tuple) -> Histogram:
            return Histogram(f"vllm:{name}", documentation, buckets=buckets, **common)

        self.ttft = histogram("time_to_first_token_seconds", "TTFT", VLLM_TTFT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency", VLLM_LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Time waiting", VLLM_LATENCY_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds", "Prefill", VLLM_LATENCY_BUCKETS)
        self.decode = histogram("request_decode_time_seconds", "Decode", VLLM_LATENCY_BUCKETS)
        self.tpot = histogram(
            "request_time_per_output_token_seconds", "Mean time per output token", VLLM_TPOT_BUCKETS
        )
        self.prompt_lengths = histogram(
            "request_prompt_tokens", "Prompt tokens", VLLM_TOKEN_BUCKETS
        )
        self.output_lengths = histogram(
            "request_generation_tokens", "Generated tokens", VLLM_TOKEN_BUCKETS
        )
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens", **common)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens", **common)
        self.success = Counter(
            "vllm:request_success",
            "Finished requests",
            labelnames=["model_name", "finished_reason"],
            registry=registry,
        )

    def observe(self, output: RequestOutput) -> None:
        """One finished request: its timings, token counts and finish reasons."""
        name, m = self.model_name, output.metrics
        generated = sum(len(o.token_ids) for o in output.outputs)
        for histogram, seconds in self._phases(output):
            if seconds is not None:
                histogram.labels(name).observe(max(seconds, 0.0))
        if m.first_token_time is not None and m.finished_time is not None and generated > 1:
            self.tpot.labels(name).observe((m.finished_time - m.first_token_time) / (generated - 1))
        self.prompt_lengths.labels(name).observe(len(output.prompt_token_ids))
        self.output_lengths.labels(name).observe(generated)
        self.prompt_tokens.labels(name).inc(len(output.prompt_token_ids))
        self.generation_tokens.labels(name).inc(generated)
        for o in output.outputs:
            self.success.labels(name, str(o.finish_reason or "abort")).inc()

    def _phases(self, output: RequestOutput) -> list[tuple[Histogram, float | None]]:
        m = output.metrics

        def between(start: float | None, end: float | None) -> float | None:
            return None if start is None or end is None else end - start

        return [
            (self.ttft, m.ttft),
            (self.e2e, between(m.arrival_time, m.finished_time)),
            (self.queue, between(m.arrival_time, m.first_scheduled_time)),
            (self.prefill, between(m.first_scheduled_time, m.first_token_time)),
            (self.decode, between(m.first_token_time, m.finished_time)),
        ]
