"""Key affinity through the router over two real replicas (the tiny model).

Round-robin is the base policy here, so a key's first request alternates replicas and only
affinity can keep later ones in place. The last test kills a replica.
"""

from __future__ import annotations

import logging

import httpx

import loopback
from prefixcache.router.forward import REPLICA_HEADER
from router_fixtures import metric_total, running_router
from test_router import AUTH, Cluster, chat, cluster  # noqa: F401  (the module's replicas)

BETA = {"Authorization": "Bearer sk-beta"}
KEYS = [f"secret-key-{name}" for name in "abcd"]


def kept(state) -> float:
    return _outcome(state, "kept")


def _outcome(state, outcome: str) -> float:
    return sum(
        sample.value
        for family in state.metrics.registry.collect()
        for sample in family.samples
        if sample.name == "prefixcache_router_key_affinity_total"
        and sample.labels["outcome"] == outcome
    )


def post(client: httpx.Client, doc: str, key: str | None, headers=AUTH, path="chat") -> str:
    """The replica that answered one request (chat, or a text completion)."""
    extra = {} if key is None else {"prompt_cache_key": key}
    if path == "chat":
        response = client.post(
            "/v1/chat/completions", json=chat(doc, "Hi?", **extra), headers=headers
        )
    else:
        body = {"model": "tiny", "prompt": f"About {doc}:", "max_tokens": 2, **extra}
        response = client.post("/v1/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    return response.headers[REPLICA_HEADER]


def test_one_key_stays_on_one_replica_and_keys_spread(cluster: Cluster, caplog) -> None:  # noqa: F811
    caplog.set_level(logging.INFO, logger="prefixcache.router")
    with (
        running_router(cluster.config("round-robin")) as (url, state),
        loopback.Client(base_url=url, timeout=30) as client,
    ):
        placed = {key: [post(client, f"{key}doc{i}", key) for i in range(3)] for key in KEYS}
        placed[KEYS[0]].append(post(client, "adoc-text", KEYS[0], path="text"))
        for key, replicas in placed.items():
            assert len(set(replicas)) == 1, f"key {key} moved: {replicas}"
        assert len({replicas[0] for replicas in placed.values()}) == 2  # the keys spread
        assert kept(state) == 9 and _outcome(state, "first") == 4
        # Without a key, round-robin alone: consecutive requests alternate.
        assert len({post(client, f"nokey{i}", None) for i in range(2)}) == 2
        # The same key from another tenant is another key: a first request.
        post(client, "beta-doc", KEYS[0], headers=BETA)
        assert _outcome(state, "first") == 5
        metrics = client.get("/metrics", headers=AUTH).text
        assert 'prefixcache_router_key_affinity_total{outcome="kept"} 9.0' in metrics
        assert "secret-key" not in metrics
    assert "reason=affinity" in caplog.text and "secret-key" not in caplog.text


def test_affinity_off_ignores_keys(cluster: Cluster) -> None:  # noqa: F811
    with (
        running_router(cluster.config("round-robin", affinity_keys=0)) as (url, state),
        loopback.Client(base_url=url, timeout=30) as client,
    ):
        assert len({post(client, f"off{i}", "same") for i in range(2)}) == 2
        assert kept(state) == 0


def test_a_killed_replica_moves_the_key_and_the_key_follows(cluster: Cluster) -> None:  # noqa: F811
    with (
        running_router(cluster.config("round-robin")) as (url, state),
        loopback.Client(base_url=url, timeout=30) as client,
    ):
        home = post(client, "mole0", "m")
        assert post(client, "mole1", "m") == home
        victim = next(r for r in cluster.replicas if r.url == home)
        victim.kill()
        moved = post(client, "mole2", "m")  # the dead replica refuses: retried, key moved
        assert moved != home
        assert [post(client, f"mole{i}", "m") for i in range(3, 5)] == [moved, moved]
        # mole2 went to the key's replica first (kept) and its retry moved the key, unless a
        # health check had taken the replica out already (then it moved at once).
        assert _outcome(state, "moved") == 1 and kept(state) in (3, 4)
        assert metric_total(state, "prefixcache_router_requests_total") >= 5
