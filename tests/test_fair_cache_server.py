"""Tenant-fair caching through the engine and the real server on loopback (``--fair-cache``)."""

from __future__ import annotations

import json
import random

import httpx
import pytest

import loopback
from engine_fixtures import assert_pool_clean, run_to_completion, tiny_engine
from prefixcache.cli import build_parser
from prefixcache.engine.sampling import SamplingParams
from prefixcache.protocol.auth import Tenants
from prefixcache.server.cli import describe_fair_cache, fair_shares
from server_fixtures import running_server, wait_idle

POOL, BLOCK = 80, 4  # 320 tokens; a live B request holds 26 blocks, A's half of the rest > 17
SYSTEM = [random.Random(5).randrange(1000, 40000) for _ in range(64)]  # 16 blocks
ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def key_file(tmp_path, **shares: float):
    tenants = [{"name": name, "keys": [f"sk-{name}"]} for name in ("A", "B")]
    tenants.append({"name": "ops", "keys": ["sk-ops"], "admin": True})  # reads /metrics only
    for tenant in tenants:
        if tenant["name"] in shares:
            tenant["cache_share"] = shares[tenant["name"]]
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"tenants": tenants}))
    return path


def serve_args(path, *flags: str):
    return build_parser().parse_args(["serve", "--api-key-file", str(path), *flags])


def complete(client: httpx.Client, tenant: str, prompt: list[int]) -> int:
    """One completion of a token-id prompt for ``tenant``; its cached prompt tokens."""
    reply = client.post(
        "/v1/completions",
        headers={"Authorization": f"Bearer sk-{tenant}"},
        json={"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0},
    )
    assert reply.status_code == 200, reply.text
    return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def flood_scenario(url: str) -> int:
    """A caches SYSTEM; B sends unique prompts totalling 10x the pool; A's next hit."""
    rng = random.Random(6)
    with loopback.Client(base_url=url, timeout=60) as client:
        complete(client, "A", SYSTEM + [11, 12, 13, 14])
        for _ in range(10 * POOL * BLOCK // 100):
            complete(client, "B", [rng.randrange(1000, 40000) for _ in range(100)])
        hit = complete(client, "A", SYSTEM + [21, 22, 23, 24])
        metrics = client.get("/metrics", headers={"Authorization": "Bearer sk-ops"}).text
    return hit, metrics


@pytest.mark.parametrize("fair", [True, False])
def test_the_flood_scenario_through_the_server(tmp_path, fair):
    path = key_file(tmp_path)
    args = serve_args(path, *(["--fair-cache"] if fair else []))
    tenants = Tenants.from_file(path)
    shares = fair_shares(args, tenants)
    engine = tiny_engine(num_kv_blocks=POOL, block_size=BLOCK, owner_shares=shares)
    with running_server(engine, tenants) as (url, state):
        hit, metrics = flood_scenario(url)
        wait_idle(state)
    assert hit == (len(SYSTEM) if fair else 0)
    if fair:
        assert 'prefixcache_tenant_evictions_suffered_total{tenant="A"} 0.0' in metrics
        assert 'prefixcache_tenant_cache_share{tenant="B"} 0.5' in metrics
        assert 'prefixcache_tenant_cached_blocks{tenant="A"}' in metrics
        caused = _sample(metrics, 'prefixcache_tenant_evictions_caused_total{tenant="B"}')
        assert caused >= 8 * POOL
    else:
        assert "prefixcache_tenant_" not in metrics  # no per-tenant accounting when off
        assert "prefixcache_fair_admission_deferrals_total 0.0" in metrics
    assert_pool_clean(engine)


def _sample(metrics: str, name: str) -> float:
    line = next(line for line in metrics.splitlines() if line.startswith(name))
    return float(line.rsplit(" ", 1)[1])


def test_fair_cache_flag_and_cache_share_in_the_key_file(tmp_path):
    path = key_file(tmp_path, A=0.75)
    tenants = Tenants.from_file(path)
    assert tenants.cache_shares() == {"A": 0.75}
    assert fair_shares(serve_args(path, "--fair-cache"), tenants) == {"A": 0.75}
    assert fair_shares(serve_args(path), tenants) is None
    assert describe_fair_cache(serve_args(path, "--fair-cache"), tenants) == (
        "fair cache: on; shares A 0.75, the rest split equally"
    )
    assert "cache_share ignored: A 0.75" in describe_fair_cache(serve_args(path), tenants)
    assert Tenants(None).cache_shares() == {}


@pytest.mark.parametrize(
    ("shares", "message"),
    [
        ({"A": 0}, r"cache share of 'A' must be a number in \(0, 1\], got 0"),
        ({"A": "all"}, r"cache share of 'A' must be a number in \(0, 1\], got 'all'"),
        ({"A": 0.5, "B": 0.75}, r"cache shares sum to 1.25; at most 1"),
    ],
)
def test_a_bad_cache_share_is_refused_at_load(tmp_path, shares, message):
    with pytest.raises(ValueError, match=message):
        Tenants.from_file(key_file(tmp_path, **shares))


def test_blocks_two_owners_share_are_charged_to_one_of_them_once():
    engine = tiny_engine(num_kv_blocks=POOL, block_size=BLOCK, owner_shares={})
    engine.add_request("a", SYSTEM, ONE_TOKEN, cache_salt="salt", owner="acme")
    engine.add_request("b", SYSTEM, ONE_TOKEN, cache_salt="salt", owner="globex")
    assert [engine.requests[r].owner for r in ("a", "b")] == ["acme", "globex"]
    run_to_completion(engine)
    usage = {u.name: u.cached_blocks for u in engine.manager.owner_usage()}
    assert sum(usage.values()) == len(SYSTEM) // BLOCK  # b shared a's blocks; one owner pays
    assert_pool_clean(engine)
