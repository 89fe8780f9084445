"""Key affinity on hand-made candidates: a key stays, moves when its replica cannot take it."""

from __future__ import annotations

import argparse
import json

import pytest

from prefixcache.router.affinity import DEFAULT_MAX_KEYS, KeyAffinity, key_digest, overloaded
from prefixcache.router.cli import add_route_parser, build_config
from prefixcache.router.index import Overlap
from prefixcache.router.policy import CacheAware, CacheAwareWeights, Candidate, RoundRobin
from prefixcache.router.prompts import routing_view

A, B, C = "http://a", "http://b", "http://c"
K1, K2 = key_digest("alpha", "k1"), key_digest("alpha", "k2")


def route(affinity: KeyAffinity, key: bytes | None, candidates, policy=None) -> tuple[str, str]:
    choice, outcome = affinity.choose(key, policy or RoundRobin(), [], candidates)
    return choice.url, outcome


def test_a_key_stays_on_its_first_replica_and_other_keys_spread() -> None:
    affinity, policy = KeyAffinity(), RoundRobin()
    candidates = [Candidate(A), Candidate(B)]
    first = route(affinity, K1, candidates, policy)
    assert first[1] == "first"
    assert [route(affinity, K1, candidates, policy) for _ in range(5)] == [(first[0], "kept")] * 5
    assert route(affinity, K2, candidates, policy)[0] != first[0]  # round-robin moved on


def test_no_key_is_the_policy_alone() -> None:
    affinity, policy = KeyAffinity(), RoundRobin()
    urls = [route(affinity, None, [Candidate(A), Candidate(B)], policy) for _ in range(4)]
    assert urls == [(A, None), (B, None), (A, None), (B, None)]
    assert len(affinity) == 0


def test_the_key_beats_a_better_cached_prefix_elsewhere_while_load_allows() -> None:
    affinity, policy = KeyAffinity(), CacheAware()
    digests = [b"x"] * 8
    assert affinity.choose(K1, policy, digests, [Candidate(A), Candidate(B, 1.0)]).choice.url == A
    warm_b = [Candidate(A, 2.0), Candidate(B, 0.0, Overlap(8, 0))]
    choice, outcome = affinity.choose(K1, policy, digests, warm_b)
    assert (choice.url, choice.reason, outcome) == (A, "affinity", "kept")


def test_an_overloaded_replica_loses_the_key_and_the_key_follows() -> None:
    weights = CacheAwareWeights(balance_abs_threshold=4, balance_rel_threshold=1.5)
    affinity, policy = KeyAffinity(weights=weights), CacheAware(weights)
    assert route(affinity, K1, [Candidate(A), Candidate(B, 1)], policy) == (A, "first")
    assert route(affinity, K1, [Candidate(A, 4), Candidate(B, 0)], policy) == (A, "kept")
    assert route(affinity, K1, [Candidate(A, 9), Candidate(B, 2)], policy) == (B, "moved")
    assert route(affinity, K1, [Candidate(A, 0), Candidate(B, 0)], policy) == (B, "kept")


def test_a_replica_gone_from_the_candidates_moves_the_key() -> None:
    affinity = KeyAffinity()
    assert route(affinity, K1, [Candidate(A), Candidate(B)]) == (A, "first")
    assert route(affinity, K1, [Candidate(B), Candidate(C)]) == (B, "moved")
    assert route(affinity, K1, [Candidate(A), Candidate(B)]) == (B, "kept")


def test_tenants_keys_are_distinct_and_the_raw_key_is_not_kept() -> None:
    assert key_digest("alpha", "k") != key_digest("beta", "k")
    assert key_digest("ab", "c") != key_digest("a", "bc")
    assert b"k1" not in K1 and len(K1) == 16


def test_memory_is_bounded_least_recent_key_forgotten_first() -> None:
    affinity = KeyAffinity(max_keys=2)
    k3 = key_digest("alpha", "k3")
    candidates = [Candidate(A), Candidate(B), Candidate(C)]
    policy = RoundRobin()
    assert route(affinity, K1, candidates, policy) == (A, "first")
    assert route(affinity, K2, candidates, policy) == (B, "first")
    assert route(affinity, K1, candidates, policy) == (A, "kept")  # K1 now most recent
    assert route(affinity, k3, candidates, policy) == (C, "first")  # K2 forgotten
    assert len(affinity) == 2
    assert route(affinity, K2, candidates, policy)[1] == "first"
    assert route(affinity, K1, candidates, policy)[1] == "first"  # k3 and K2 were newer


def test_the_load_rule_is_the_balance_guard_for_one_replica() -> None:
    w = CacheAwareWeights(balance_abs_threshold=16, balance_rel_threshold=1.5)
    loads = [Candidate(A, 17), Candidate(B, 0)]
    assert overloaded(loads[0], loads, w) and not overloaded(loads[1], loads, w)
    near = [Candidate(A, 16), Candidate(B, 0)]
    assert not overloaded(near[0], near, w)
    relative = [Candidate(A, 40), Candidate(B, 30)]
    assert not overloaded(relative[0], relative, w)


def route_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="prefixcache")
    add_route_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["route", "--replica", "http://a", *argv])


def test_the_flag_sizes_the_lru_and_zero_turns_affinity_off(capsys) -> None:
    config = build_config(route_args("--policy", "round-robin", "--affinity-keys", "7"))
    assert config.affinity_keys == 7
    assert build_config(route_args("--policy", "round-robin")).affinity_keys == DEFAULT_MAX_KEYS
    with pytest.raises(SystemExit):
        route_args("--affinity-keys", "-1")
    assert "--affinity-keys: -1 must be >= 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("body", "key"),
    [
        ({"prompt_cache_key": "tenant-docs"}, "tenant-docs"),
        ({"prompt_cache_key": ""}, None),
        ({"prompt_cache_key": 5}, None),  # the replica refuses it; the router just forwards
        ({}, None),
    ],
)
def test_the_key_is_read_from_the_body(body: dict, key: str | None) -> None:
    raw = json.dumps({"model": "m", "prompt": "hi", **body}).encode()
    assert routing_view(raw, "completions", tokenizer=None).cache_key == key
    assert routing_view(raw, "chat", tokenizer=None).cache_key == key
