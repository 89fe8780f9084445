"""The server over a disk tier: warm after a restart, tenants kept apart, metrics split."""

from __future__ import annotations

import argparse
import json
import os
import stat

from prometheus_client.parser import text_string_to_metric_families

import loopback
from engine_fixtures import assert_pool_clean, tiny_engine
from prefixcache.protocol.auth import Tenants
from prefixcache.protocol.tenant_secret import load_or_create_secret
from prefixcache.server.cli import tenant_secrets
from server_fixtures import running_server, wait_idle

SYSTEM = "Quokka ferry desk: answer in one short sentence, please. " * 5


def ask(url: str, question: str, key: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {
        "model": "tiny",
        "max_tokens": 3,
        "temperature": 0,
        "ignore_eos": True,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
    }
    reply = loopback.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def metric(url: str, name: str, **labels: str) -> float:
    text = loopback.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise AssertionError(f"{name} {labels} not in /metrics")


def serve_once(folder, question: str, tenants: Tenants | None = None) -> tuple[dict, dict]:
    """A fresh engine and server on the disk tier in ``folder``: one answer and its metrics."""
    args = argparse.Namespace(tenant_secret_file=None, kv_tier=f"disk:{folder}")
    tenants = tenants or Tenants(None, tenant_secrets(args).current)
    engine = tiny_engine(num_kv_blocks=200, kv_tier=f"disk:{folder}")
    with running_server(engine, tenants) as (url, state):
        answer = ask(url, question)
        wait_idle(state)
        assert engine.tier.client.flush(timeout=10)
        hits = {
            s: metric(url, "prefixcache_cached_tokens_total", source=s) for s in ("pool", "tier")
        }
        assert_pool_clean(engine)
    engine.close()
    return answer, hits


def test_a_restarted_server_is_warm_from_its_disk_tier(tmp_path):
    folder = tmp_path / "tier"
    cold, cold_hits = serve_once(folder, "When does the ferry leave?")
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert cold_hits == {"pool": 0, "tier": 0}
    warm, warm_hits = serve_once(folder, "Is there a cafe on board?")
    cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 64  # the system prompt's blocks came back from disk
    assert warm_hits == {"pool": 0, "tier": cached}
    secret = folder / "tenant-secret"
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600


def test_without_the_shared_secret_a_restart_shares_nothing(tmp_path):
    folder = tmp_path / "tier"
    serve_once(folder, "When does the ferry leave?", Tenants(None, os.urandom(32)))
    warm, _ = serve_once(folder, "Is there a cafe?", Tenants(None, os.urandom(32)))
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_tenant_marked_tier_false_never_reaches_the_tier(tmp_path):
    keys = tmp_path / "keys.json"
    tenants = [
        {"name": "open", "keys": ["sk-open"]},
        {"name": "closed", "keys": ["sk-closed"], "tier": False},
        {"name": "private", "keys": ["sk-private"], "no_reuse": True},
    ]
    keys.write_text(json.dumps({"tenants": tenants}))
    loaded = Tenants.from_file(keys, load_or_create_secret(tmp_path / "secret"))
    engine = tiny_engine(num_kv_blocks=200, kv_tier=f"disk:{tmp_path / 'tier'}")
    with running_server(engine, loaded) as (url, state):
        for key in ("sk-closed", "sk-private"):
            ask(url, "Which pier?", key)
        wait_idle(state)
        assert engine.tier.client.flush(timeout=10)
        assert engine.tier.client.stats.writes == 0
        ask(url, "Which pier?", "sk-open")
        wait_idle(state)
        assert engine.tier.client.flush(timeout=10)
        assert engine.tier.client.stats.writes > 0
    engine.close()


def test_a_block_file_swapped_for_a_symlink_is_a_counted_miss_in_metrics(tmp_path):
    folder, outside = tmp_path / "tier", tmp_path / "outside"
    serve_once(folder, "When does the ferry leave?")
    outside.write_bytes(b"\0" * 1024)
    links = sorted(folder.glob("??/*.kvb"))
    for block in links:  # every stored block becomes a link to elsewhere
        block.unlink()
        block.symlink_to(outside)
    args = argparse.Namespace(tenant_secret_file=None, kv_tier=f"disk:{folder}")
    engine = tiny_engine(num_kv_blocks=200, kv_tier=f"disk:{folder}")
    with running_server(engine, Tenants(None, tenant_secrets(args).current)) as (url, state):
        warm = ask(url, "Is there a cafe on board?")
        wait_idle(state)
        refused = metric(url, "prefixcache_tier_rejected_files_total", medium="disk")
        assert refused == len(links) > 0
        assert metric(url, "prefixcache_cached_tokens_total", source="tier") == 0
    engine.close()
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert outside.read_bytes() == b"\0" * 1024  # never written through, never removed
    assert not any(path.is_symlink() for path in links)
