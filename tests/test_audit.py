"""``prefixcache audit-timing``: the statistics, and a real run against a live server.

The run serves a random-weight model as wide as the default one (576 wide, 9 heads, the real
tokenizer) with 6 of its 30 layers: what the audit measures is whether a cached prefix is
faster than a fresh one, which depends on the prefill's cost, not on the weights, and a
sixth of the layers keeps the 108 probes short. A ~200-token prefill still costs several
times what a hit costs, so real reuse scores AUC ~1.0.

Bounds: with 12 trials per scenario the AUC of two identical TTFT distributions has a
standard deviation of sqrt(25 / 1728) = 0.12 around 0.5. Across tenants and for the no-reuse
tenant we assert AUC < 0.85, 2.9 standard deviations above 0.5: a false failure about once
in 500 runs per assertion on a noisy shared machine. Within the tenant we assert > 0.9.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from engine_fixtures import default_model, random_state_dict
from prefixcache.engine.engine import EngineConfig, LLMEngine
from prefixcache.engine.weights import LoadedModel
from prefixcache.protocol.auth import Tenants
from prefixcache.tools.audit import (
    Scenario,
    ScenarioResult,
    audit,
    has_leak,
    null_sd,
    percentile,
    report,
    roc_auc,
    scenarios,
)
from prefixcache.tools.audit_client import ProbeClient
from server_fixtures import running_server, wait_idle, write_key_file

AUDIT_LAYERS = 6


def test_auc_percentiles_and_noise():
    assert roc_auc([1, 2], [3, 4]) == 1.0 and roc_auc([3, 4], [1, 2]) == 0.0
    assert roc_auc([1, 2], [1, 2]) == 0.5
    assert percentile([1, 2, 3, 4, 5], 50) == 3 and percentile([0, 10], 10) == 1.0
    assert null_sd(12, 12) == pytest.approx(0.1203, abs=1e-3)


def test_verdicts_and_the_leak_exit_rule():
    within = ScenarioResult(Scenario("within one tenant", "a", "a", True), [0.1] * 12, [1.0] * 12)
    across = ScenarioResult(Scenario("across tenants", "a", "b", False), [0.1] * 12, [1.0] * 12)
    lines = report("http://x", "m", 300, [within, across])
    assert "the price of sharing" in lines[-2] and "LEAK" in lines[-1]
    assert has_leak([within, across]) and not has_leak([within])
    few = ScenarioResult(across.scenario, [0.1] * 4, [1.0] * 4)
    assert "too few trials" in report("http://x", "m", 300, [few])[-1]
    fair = ScenarioResult(across.scenario, [0.1, 0.3] * 6, [0.2, 0.4] * 6)
    assert "within noise" in report("http://x", "m", 300, [fair])[-1]
    assert [s.name for s in scenarios(["a", "b"], "c")] == [
        "within one tenant",
        "across tenants",
        "no-reuse tenant",
    ]


def audit_model() -> LoadedModel:
    """The default model's width and tokenizer, 6 layers, random weights."""
    real = default_model()
    config = dataclasses.replace(real.config, num_layers=AUDIT_LAYERS, name="audit-random")
    return LoadedModel(config, random_state_dict(config), real.tokenizer, Path("audit-random"))


@pytest.fixture(scope="module")
def audit_server(tmp_path_factory):
    tenants = Tenants.from_file(write_key_file(tmp_path_factory.mktemp("keys")))
    engine = LLMEngine(audit_model(), EngineConfig(num_kv_blocks=1024))
    with running_server(engine, tenants, model_name="audit-random") as (url, state):
        yield url, state


def test_timing_separates_hits_only_within_a_tenant(audit_server):
    url, state = audit_server
    client = ProbeClient(url)
    found = scenarios(["sk-alpha", "sk-beta"], "sk-private")
    try:
        tokens, results = audit(client, found, trials=12, words=200, seed=0)
    finally:
        client.close()
    text = "\n".join(report(url, client.model, tokens, results))
    print(text)
    within, across, no_reuse = (result.auc for result in results)
    assert tokens >= 180 and within > 0.9, text
    assert across < 0.85 and no_reuse < 0.85, text
    wait_idle(state)
