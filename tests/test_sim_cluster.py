"""Cluster simulation on hand-made traces, with the routing computed by hand."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from prefixcache.sim.cluster import ServiceModel, simulate_cluster
from prefixcache.sim.cluster_report import cluster_table, plot_replicas, sweep_replicas
from prefixcache.sim.traces import MooncakeRequest, Trace

# Two prompt families (ids 1-2-3 and 7-8-9), interleaved, far apart in time (no load).
FAMILIES = [[1, 2, 3], [7, 8, 9], [1, 2, 3], [7, 8, 9], [1, 2, 3], [7, 8, 9]]


def trace(families: list[list[int]], gap_ms: float = 10_000.0) -> Trace:
    requests = [
        MooncakeRequest(index * gap_ms, 512 * len(ids), 4, list(ids))
        for index, ids in enumerate(families)
    ]
    return Trace(Path("hand-made"), "mooncake", requests)


def test_round_robin_over_two_replicas_splits_each_family():
    # r0 -> A, r1 -> B, r2 (family 1) -> A: hit 3, r3 (family 2) -> B: hit 3, ...
    # with two families and two replicas round-robin happens to align; three break it.
    result = simulate_cluster(trace(FAMILIES), 2, 10, "round-robin")
    assert result.per_replica == [3, 3]
    assert (result.blocks, result.hit_blocks) == (18, 12)
    three = trace([[1, 2, 3]] * 6)
    spread = simulate_cluster(three, 3, 10, "round-robin")
    assert spread.hit_blocks == 3 * 3  # each replica misses once, then hits 3 blocks twice


def test_cache_aware_keeps_each_family_on_one_replica():
    result = simulate_cluster(trace([[1, 2, 3]] * 6), 3, 10, "cache-aware")
    assert sorted(result.per_replica) == [0, 0, 6]  # idle replicas: load 0 everywhere
    assert result.hit_blocks == 5 * 3
    assert result.hit_rate == result.ideal_hit_rate == 15 / 18


def test_load_pushes_cache_aware_to_another_replica():
    # Requests 1 ms apart, each busy for 10 s. cost = 3 blocks - pool hit + load:
    # r0 ties (3, 3) -> A; r1 A 0+1 vs B 3 -> A; r2 A 0+2 -> A; r3 A 0+3 ties B 3+0 and B is
    # less loaded -> B (a miss); r4 A 3 vs B 0+1 -> B; r5 A 3 vs B 0+2 -> B.
    busy = ServiceModel(fixed=10.0)
    result = simulate_cluster(
        trace([[1, 2, 3]] * 6, gap_ms=1.0), 2, 10, "cache-aware", service=busy
    )
    assert result.per_replica == [3, 3]
    assert result.hit_blocks == 4 * 3  # two misses, one on each replica


def test_a_shared_tier_is_credited_after_the_pool():
    result = simulate_cluster(trace([[1, 2, 3]] * 4), 2, 10, "round-robin", shared_tier=20)
    # A: miss; B: tier 3; A: pool 3; B: pool 3 -> 9 of 12 blocks, 3 of them from the tier
    assert (result.hit_blocks, result.tier_blocks, result.blocks) == (6, 3, 12)
    assert result.hit_rate == 9 / 12


def test_the_table_and_the_plot(tmp_path):
    sweep = sweep_replicas(trace(FAMILIES), 3, 10, ["cache-aware", "round-robin"])
    lines = cluster_table([results[-1] for results in sweep.values()])
    assert lines[0].startswith("cluster: 3 replicas x 10 blocks")
    assert "cache-aware" in lines[2] and "round-robin" in lines[3]
    plot_replicas(sweep, tmp_path / "replicas.png", "hand-made")
    assert (tmp_path / "replicas.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_key_affinity_keeps_a_key_on_one_replica_where_cache_aware_spreads():
    # Six different prompts, one cache_key: nothing shared, so cache-aware's ties rotate,
    # while key affinity (the router's own rule) keeps the key where it first went.
    requests = [
        MooncakeRequest(index * 10_000.0, 512, 4, [100 + index], cache_key=5) for index in range(6)
    ]
    keyed = Trace(Path("hand-made"), "mooncake", requests)
    spread = simulate_cluster(keyed, 2, 10, "cache-aware")
    assert spread.per_replica == [3, 3]
    kept = simulate_cluster(keyed, 2, 10, "key-affinity")
    assert sorted(kept.per_replica) == [0, 6] and kept.affinity_kept == 5
    unkeyed = Trace(Path("hand-made"), "mooncake", [replace(r, cache_key=None) for r in requests])
    assert simulate_cluster(unkeyed, 2, 10, "key-affinity").per_replica == [3, 3]


def test_key_affinity_yields_to_load():
    # Back-to-back long requests with one key: the key's replica fills up, the key moves.
    requests = [MooncakeRequest(float(i), 512, 2000, [200 + i], cache_key=1) for i in range(40)]
    keyed = Trace(Path("hand-made"), "mooncake", requests)
    result = simulate_cluster(keyed, 2, 50, "key-affinity")
    assert min(result.per_replica) > 0 and result.affinity_kept < 39
