"""deploy/'s Grafana dashboard and Prometheus rules against the real thing (issue 37).

promtool checks the rules and runs their unit tests (deploy/prometheus/rules_test.yml: the
production windows, thresholds and ``for:``). Then a real Prometheus (Debian's package,
``make system-tools``), configured from deploy/prometheus/prometheus.yml, scrapes every second
a real ``prefixcache serve`` (the tiny model, a Redis tier on a real redis-server, KV events,
``--fair-cache``, tenants), a real ``prefixcache route`` in front of it, and a second replica
served from this process, whose event publisher the test breaks. After a short load every
dashboard panel's expression and every recording rule returns series; then a flood of
unique prompts, a killed Redis and a broken events socket fire every alert of rules.yml (a
copy with short windows: ``prometheus_fixtures.WINDOWS``).
"""

from __future__ import annotations

import random
import re
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import yaml
import zmq

import loopback
from engine_fixtures import tiny_engine
from prefixcache.protocol.auth import Tenants
from prefixcache.protocol.tenant_secret import load_or_create_secret
from prefixcache.server.app import create_app
from prefixcache.server.events import KVEventPublisher, sink_for
from prometheus_fixtures import (
    DASHBOARD,
    PROMETHEUS_DIR,
    RULES,
    VARIABLES,
    PrometheusProcess,
    dashboard_targets,
    fill,
    load_dashboard,
    promtool,
    rule_groups,
    rules_for_a_short_run,
)
from redis_fixtures import RedisProcess, redis_server
from router_fixtures import ReplicaProcess, serving, write_tiny_hf_model
from router_process import RouterProcess
from server_fixtures import free_port, write_key_file

pytestmark = pytest.mark.slow

ALPHA, BETA = {"Authorization": "Bearer sk-alpha"}, {"Authorization": "Bearer sk-beta"}
SYSTEM = "Quokka ferry desk. Answer in one short sentence about ferries, piers and tickets. " * 2
SERIES_TIMEOUT_S = 30.0  # after the load, until every expression returns series
ALERTS_TIMEOUT_S = 45.0  # after the provocation, until every alert has fired
FLOOD_WORKERS = 8  # concurrent unique prompts: a queue behind --max-num-seqs 1
FLOOD_TOKENS = 200  # generated per flood request (~0.35 s each on the tiny model)


# --- static checks -------------------------------------------------------------------


def test_promtool_passes_the_rules_their_unit_tests_and_the_example_config(tmp_path: Path):
    assert "SUCCESS" in promtool("check", "rules", RULES)
    assert "SUCCESS" in promtool("test", "rules", PROMETHEUS_DIR / "rules_test.yml")
    # --syntax-only: the example's admin key file exists on a deployed machine, not here
    promtool("check", "config", "--syntax-only", PROMETHEUS_DIR / "prometheus.yml")
    short = tmp_path / "rules.yml"
    short.write_text(rules_for_a_short_run(RULES.read_text()))
    assert "SUCCESS" in promtool("check", "rules", short)


def test_every_alert_has_a_duration_severity_and_annotations():
    alerts = [rule for rule in rule_groups(RULES.read_text()) if "alert" in rule]
    assert len(alerts) == 6
    for alert in alerts:
        name = alert["alert"]
        assert name.startswith("Prefixcache"), name
        assert re.fullmatch(r"\d+m", alert.get("for", "")), f"{name}: for: in minutes"
        assert alert["labels"]["severity"] in ("warning", "critical"), name
        assert {"summary", "description"} <= alert["annotations"].keys(), name
    records = [rule["record"] for rule in rule_groups(RULES.read_text()) if "record" in rule]
    assert all(record.startswith("prefixcache:") for record in records), records


def test_the_dashboard_is_ready_for_file_provisioning():
    dashboard = load_dashboard()
    assert dashboard["uid"] == "prefixcache" and dashboard["title"]
    # import-only placeholders (${DS_...} and __inputs) are not resolved by file provisioning
    assert "__inputs" not in dashboard and "DS_" not in DASHBOARD.read_text()
    variables = {var["name"]: var for var in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    source = {"type": "prometheus", "uid": "${datasource}"}
    panels = [panel for panel in dashboard["panels"] if panel["type"] != "row"]
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    used = set()
    for panel in panels:
        assert panel["datasource"] == source, panel["title"]
        assert panel["targets"] and panel.get("description"), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == source and target["expr"].strip(), panel["title"]
            used |= {a or b for a, b in re.findall(r"\$\{(\w+)\}|\$(\w+)", target["expr"])}
    assert used - {"__rate_interval"} <= variables.keys(), used
    assert used <= VARIABLES.keys()
    assert_no_overlap(dashboard["panels"])


def assert_no_overlap(panels: list[dict]) -> None:
    """Grid positions inside 24 columns, no two panels on the same cell."""
    taken: dict[tuple[int, int], str] = {}
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in taken, f"{panel['title']} overlaps {taken[(x, y)]}"
                taken[(x, y)] = panel["title"]


# --- the real thing ------------------------------------------------------------------


@dataclass
class Stack:
    """What Prometheus scrapes, and the handles the test provokes alerts with."""

    replica: ReplicaProcess  # `prefixcache serve`, Redis tier, events, --fair-cache
    replica_target: str  # its --metrics-port, as Prometheus labels it (instance)
    router: RouterProcess
    redis: RedisProcess
    publisher: KVEventPublisher  # of the in-process replica
    events_target: str
    prometheus: PrometheusProcess


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    with ExitStack() as exits:
        redis = exits.enter_context(redis_server())
        model = write_tiny_hf_model(tmp_path / "tiny")
        keys, secret = write_key_file(tmp_path), tmp_path / "tenant-secret"
        load_or_create_secret(secret)
        metrics_port = free_port()
        replica = ReplicaProcess(model, tmp_path, replica_args(redis, keys, secret, metrics_port))
        exits.callback(replica.stop)
        replica.start()
        publisher, events_url = in_process_replica(exits)
        router = RouterProcess(
            [replica.url], tmp_path,
            ("--model", str(model), "--api-key-file", str(keys), "--tenant-secret-file",
             str(secret)),
        )  # fmt: skip
        exits.callback(router.stop)
        router.start()  # healthy once the replica is
        replica.wait_ready()
        replica_target = f"127.0.0.1:{metrics_port}"
        events_target = events_url.removeprefix("http://")
        config = prometheus_config(tmp_path, replica_target, events_target, router)
        prometheus = PrometheusProcess(tmp_path, config)
        exits.callback(prometheus.stop)
        prometheus.start()
        yield Stack(replica, replica_target, router, redis, publisher, events_target, prometheus)


def replica_args(redis: RedisProcess, keys: Path, secret: Path, metrics_port: int) -> tuple:
    """A pool of 128 blocks of 16 tokens (the shared load evicts none) and one seat: a flood
    evicts and queues at once."""
    return (
        "--block-size", "16", "--kv-cache-blocks", "128", "--max-num-seqs", "1",
        "--kv-tier", redis.url, "--fair-cache", "--api-key-file", str(keys),
        "--tenant-secret-file", str(secret), "--metrics-port", str(metrics_port),
    )  # fmt: skip


def in_process_replica(exits: ExitStack) -> tuple[KVEventPublisher, str]:
    """A tiny engine with a KV-event publisher, served here so the test can break the
    publisher's socket; its publisher and base URL."""
    engine = tiny_engine(num_kv_blocks=64)
    publisher = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", flush_interval_s=0.01)
    engine.set_event_sink(sink_for(publisher, include_token_ids=False))
    app = create_app(engine, Tenants(None, bytes(range(32))), "tiny", publisher=publisher)
    return publisher, exits.enter_context(serving(app))


def prometheus_config(work: Path, replica: str, events: str, router: RouterProcess) -> dict:
    """deploy/prometheus/prometheus.yml with this run's targets, the short rules copy, the
    admin key, and a scrape and evaluation every second."""
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "scrape_timeout": "1s",
                        "evaluation_interval": "1s"}  # fmt: skip
    rules = work / "rules-short.yml"
    rules.write_text(rules_for_a_short_run(RULES.read_text()))
    config["rule_files"] = [str(rules)]
    key = work / "admin-key"
    key.write_text(ALPHA["Authorization"].removeprefix("Bearer "))
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    jobs["prefixcache"]["static_configs"] = [{"targets": [replica, events]}]
    router_job = jobs["prefixcache-router"]
    router_job["authorization"]["credentials_file"] = str(key)
    router_job["static_configs"] = [{"targets": [router.url.removeprefix("http://")]}]
    return config


def wait_for_targets(prometheus: PrometheusProcess, count: int) -> None:
    """Until ``count`` targets were scraped and are up (the router's with its admin key)."""
    deadline = time.monotonic() + SERIES_TIMEOUT_S
    while True:
        up = {s["metric"]["instance"]: s["value"][1] for s in prometheus.query("up")}
        if len(up) == count and set(up.values()) == {"1"}:
            return
        assert time.monotonic() < deadline, f"targets up: {up}"
        time.sleep(0.2)


def shared_load(router: str) -> None:
    """Two tenants behind the router on one system prompt (hits), a prompt_cache_key twice
    (affinity) and a 24h retention."""
    with loopback.Client(base_url=router, timeout=60) as client:
        for i in range(12):
            for headers in (ALPHA, BETA):
                chat(client, headers, f"Which pier for trip {i}?")
        for _ in range(2):
            chat(client, ALPHA, "And the timetable?", prompt_cache_key="timetable")
        chat(client, BETA, "Kept for a day?", prompt_cache_retention="24h")


def chat(client: httpx.Client, headers: dict, question: str, **fields: str) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0, **fields}
    reply = client.post("/v1/chat/completions", json=body, headers=headers)
    assert reply.status_code == 200, reply.text


@dataclass
class Flood:
    """Tenant alpha's unique prompts, FLOOD_WORKERS at a time, until stopped: no prefix hit,
    the pool evicting alpha's blocks over its share, a queue behind the one seat."""

    url: str
    statuses: list[int] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> Flood:
        for worker in range(FLOOD_WORKERS):
            thread = threading.Thread(target=self.run, args=(worker,), daemon=True)
            thread.start()
            self.threads.append(thread)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)

    def run(self, worker: int) -> None:
        rng = random.Random(worker)
        with loopback.Client(base_url=self.url, headers=ALPHA, timeout=60) as client:
            while not self.stop.is_set():
                prompt = " ".join(f"w{rng.randrange(10**6)}" for _ in range(20))
                body = {"model": "tiny", "prompt": prompt, "max_tokens": FLOOD_TOKENS,
                        "temperature": 0, "ignore_eos": True}  # fmt: skip
                self.statuses.append(client.post("/v1/completions", json=body).status_code)


def expressions(prometheus: PrometheusProcess) -> dict[str, str]:
    """Every expression to evaluate: dashboard targets, the variables' queries, and each
    recording rule (its series and its expression); expr -> where it comes from."""
    found = {t.expr: f"panel {t.panel!r}" for t in dashboard_targets(load_dashboard())}
    for var in load_dashboard()["templating"]["list"]:
        if var["type"] == "query":
            selector, label = re.fullmatch(r"label_values\((.+), (\w+)\)", var["query"]).groups()
            found[f"count by ({label}) ({fill(selector)})"] = f"variable ${var['name']}"
    short = rule_groups(rules_for_a_short_run(RULES.read_text()))
    for rule in short:
        if "record" in rule:
            found[rule["record"]] = f"recorded {rule['record']}"
            found[rule["expr"]] = f"rule {rule['record']}"
    return found


def wait_for_series(prometheus: PrometheusProcess, exprs: dict[str, str]) -> None:
    """Until every expression returns at least one series; else name those that do not."""
    deadline = time.monotonic() + SERIES_TIMEOUT_S
    missing = prometheus.empty(list(exprs))
    while missing and time.monotonic() < deadline:
        time.sleep(1)
        missing = prometheus.empty(list(missing))
    report = "\n".join(f"{exprs[e]}: {e}\n    -> {why}" for e, why in missing.items())
    assert not missing, f"{len(missing)} expressions return no series:\n{report}"


def wait_for_rules_evaluated(prometheus: PrometheusProcess) -> None:
    """Until every rule has been evaluated; none may have failed (a matching error, ...)."""
    deadline = time.monotonic() + SERIES_TIMEOUT_S
    while any(rule["health"] == "unknown" for rule in prometheus.rules()):
        assert time.monotonic() < deadline, "rules never evaluated"
        time.sleep(0.5)
    failed = {rule["name"]: rule.get("lastError") for rule in prometheus.rules()}
    failed = {name: error for name, error in failed.items() if error}
    assert not failed, f"rules failed to evaluate: {failed}"


def expected_alerts(stack: Stack) -> dict[str, dict[str, str]]:
    """Each alert of rules.yml, and labels the firing one must carry."""
    replica = {"instance": stack.replica_target}
    return {
        "PrefixcacheHitRateDropped": replica,
        "PrefixcacheEvictionChurn": replica,
        "PrefixcacheTierBreakerOpen": {**replica, "medium": "redis"},
        "PrefixcacheKVEventsDown": {"instance": stack.events_target},
        "PrefixcacheTenantOverCacheShare": {**replica, "tenant": "alpha"},
        "PrefixcacheQueueTimeHigh": replica,
    }


def wait_for_alerts(prometheus: PrometheusProcess, expected: dict[str, dict]) -> None:
    """Until each expected alert has been seen firing with its labels (not all at once)."""
    seen: set[str] = set()
    deadline = time.monotonic() + ALERTS_TIMEOUT_S
    while seen != expected.keys() and time.monotonic() < deadline:
        for alert in prometheus.alerts():
            labels, name = alert["labels"], alert["labels"]["alertname"]
            wanted = expected.get(name)
            if alert["state"] == "firing" and wanted and wanted.items() <= labels.items():
                seen.add(name)
        time.sleep(0.5)
    states = {rule["name"]: rule.get("state") for rule in prometheus.rules() if "state" in rule}
    assert seen == expected.keys(), (
        f"alerts never fired within {ALERTS_TIMEOUT_S} s: {sorted(expected.keys() - seen)}; "
        f"rule states now {states}"
    )


def test_every_panel_and_rule_returns_series_and_every_alert_fires(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    prometheus = stack.prometheus
    wait_for_targets(prometheus, 3)
    shared_load(stack.router.url)
    wait_for_series(prometheus, expressions(prometheus))
    wait_for_rules_evaluated(prometheus)
    assert not prometheus.alerts(), "an alert before any provocation"

    with Flood(stack.replica.url) as flood:
        stack.redis.kill()  # the tier's calls fail: its breaker opens

        def broken_socket(timeout_ms: int) -> None:
            raise zmq.ZMQError(zmq.ENOTSOCK)  # as a poll of a closed socket fails

        monkeypatch.setattr(stack.publisher, "_wait", broken_socket)
        wait_for_alerts(prometheus, expected_alerts(stack))
    assert flood.statuses and set(flood.statuses) == {200}, "the tier's loss failed requests"
    wait_for_rules_evaluated(prometheus)
