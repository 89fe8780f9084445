"""The router's global index and digests, on hand-made digests (no network, no model)."""

from __future__ import annotations

import hashlib
import time

import pytest

from prefixcache.cache import KVCacheManager, Namespace
from prefixcache.router.digests import prompt_digests
from prefixcache.router.index import GlobalIndex, Overlap
from prefixcache.router.policy import Candidate, make_policy
from prefixcache.router.replicas import (
    PREFILL_TOKENS_PER_REQUEST,
    Replica,
    parse_health,
    parse_load,
    parse_pending_prefill,
    reachable,
)

A, B, C = "http://a", "http://b", "http://c"


def chain(name: str, n: int) -> list[bytes]:
    """``n`` made-up block digests of one document."""
    return [hashlib.sha256(f"{name}/{i}".encode()).digest() for i in range(n)]


def test_overlap_is_the_leading_run_in_the_pool_then_in_the_tier() -> None:
    index = GlobalIndex()
    gen = index.attach(A, tier_medium="disk")
    doc = chain("doc", 6)
    index.store(A, gen, doc[:2], "cpu")
    index.store(A, gen, doc[3:4], "cpu")  # after a miss: never counted (rule 4)
    index.store(A, gen, doc[2:5], "disk")
    assert index.overlap(A, doc) == Overlap(pool_blocks=2, tier_blocks=3)
    assert index.overlap(A, chain("other", 6)) == Overlap(0, 0)
    assert index.overlap(B, doc) == Overlap(0, 0)  # never attached
    assert index.counts(A) == (3, 3, 0)


def test_a_redis_tier_is_credited_to_every_replica_with_one_but_a_disk_tier_is_not() -> None:
    index = GlobalIndex()
    gens = {A: index.attach(A, "redis"), B: index.attach(B, "redis"), C: index.attach(C, "disk")}
    doc = chain("doc", 4)
    index.store(A, gens[A], doc, "redis")
    assert index.overlap(B, doc) == Overlap(0, 4)  # B reads the same Redis
    assert index.overlap(C, doc) == Overlap(0, 0)  # C has a disk tier of its own
    index.store(C, gens[C], doc[:2], "disk")
    assert index.overlap(A, doc[:2]) == Overlap(0, 2)
    index.detach(A)  # only live replicas' reports count: A's Redis writes go with it
    assert index.overlap(B, doc) == Overlap(0, 0)


def test_all_blocks_cleared_empties_the_pool_but_not_the_tier() -> None:
    index = GlobalIndex()
    gen = index.attach(A, "disk")
    doc = chain("doc", 4)
    index.store(A, gen, doc, "cpu")
    index.store(A, gen, doc, "disk")
    index.clear_pool(A, gen)
    assert index.overlap(A, doc) == Overlap(0, 4)
    assert index.holders(doc[0]) == set()


def test_removed_blocks_leave_only_their_replica() -> None:
    index = GlobalIndex()
    ga, gb = index.attach(A, None), index.attach(B, None)
    doc = chain("doc", 3)
    index.store(A, ga, doc, "cpu")
    index.store(B, gb, doc, "cpu")
    index.remove(A, ga, doc[1:], "cpu")
    assert index.holders(doc[0]) == {A, B} and index.holders(doc[2]) == {B}
    assert index.overlap(A, doc) == Overlap(1, 0)


def test_restart_and_detach_clear_a_replica_and_stale_generations_are_ignored() -> None:
    index = GlobalIndex()
    old = index.attach(A, None)
    doc = chain("doc", 3)
    index.store(A, old, doc, "cpu")
    new = index.restart(A, old)  # a new epoch: everything the old process held is gone
    assert new is not None and new != old
    assert index.overlap(A, doc) == Overlap(0, 0)
    assert not index.store(A, old, doc, "cpu")  # a late batch of the old epoch
    assert index.restart(A, old) is None  # an obsolete feed cannot restart it again
    assert index.store(A, new, doc[:1], "cpu")
    index.detach(A)
    assert not index.store(A, new, doc, "cpu")
    assert index.overlap(A, doc) == Overlap(0, 0) and index.replicas() == []


def test_an_expectation_counts_as_pool_blocks_until_settled() -> None:
    index = GlobalIndex()
    index.attach(A, None)
    doc = chain("doc", 5)
    first = index.expect(A, doc[:3])
    second = index.expect(A, doc[:3])
    assert index.overlap(A, doc) == Overlap(3, 0)
    index.settle(first, grace_s=0.0)
    assert index.overlap(A, doc) == Overlap(3, 0)  # the second request still holds them
    index.settle(second, grace_s=0.05)
    index.settle(second, grace_s=0.0)  # settling twice is a no-op
    assert index.overlap(A, doc) == Overlap(3, 0)
    time.sleep(0.06)
    assert index.overlap(A, doc) == Overlap(0, 0)
    assert index.counts(A).expected == 0


def test_expectations_of_a_detached_replica_vanish() -> None:
    index = GlobalIndex()
    index.attach(A, None)
    expectation = index.expect(A, chain("doc", 2))
    index.detach(A)
    index.attach(A, None)
    index.settle(expectation, 0.0)  # belongs to the old generation: nothing to undo
    assert index.overlap(A, chain("doc", 2)) == Overlap(0, 0)
    assert index.expect(B, chain("doc", 2)) is None  # unknown replica


@pytest.mark.parametrize("salt", [None, "tenant-salt"])
def test_prompt_digests_match_the_cache_managers(salt: str | None) -> None:
    manager = KVCacheManager(8, 4, namespace=Namespace(model="m", dtype="float32", block_size=4))
    tokens = list(range(100, 117))  # 17 tokens: 4 full blocks reusable (rule 10)
    ours = prompt_digests(manager.root_digest, 4, tokens, salt)
    assert ours == manager.prompt_digests(tokens, salt)
    assert len(ours) == 4
    assert len(prompt_digests(manager.root_digest, 4, tokens[:16], salt)) == 3  # last token kept
    assert prompt_digests(manager.root_digest, 4, tokens, "other")[0] != ours[0]


def test_parse_health_load_and_endpoints() -> None:
    body = {
        "status": "ok",
        "model": "tiny",
        "block_size": 4,
        "namespace_digest": "ab" * 32,
        "tier": "redis",
        "kv_events": {"endpoint": "tcp://0.0.0.0:5557", "replay": None, "topic": "kv-events.1"},
    }
    identity = parse_health(body, "http://10.0.0.7:8000")
    assert identity.root == bytes.fromhex("ab" * 32) and identity.tier == "redis"
    assert identity.events == ("tcp://10.0.0.7:5557", None, "kv-events.1")
    assert reachable("tcp://127.0.0.1:5557", "http://h:1") == "tcp://127.0.0.1:5557"
    with pytest.raises(ValueError, match="not a prefixcache replica"):
        parse_health({"status": "ok", "model": "x"}, "http://h")
    with pytest.raises(ValueError, match="not ok"):
        parse_health({"status": "starting"}, "http://h")
    text = (
        "# HELP prefixcache_requests_running Branches running\n"
        "prefixcache_requests_running 3.0\nprefixcache_requests_waiting 2.0\n"
        "prefixcache_requests_running_other 9.0\n"
    )
    assert parse_load(text) == 5.0
    assert parse_pending_prefill(text) == 0.0  # a replica that does not say
    assert parse_pending_prefill(text + "prefixcache_prefill_tokens_pending 1536.0\n") == 1536.0


def test_pending_prompt_tokens_weigh_in_a_replicas_load() -> None:
    """Two replicas with one request each: the one with a 3,000-token prefill ahead is the
    busier, and the least-loaded choice goes to the other."""
    quiet, busy = Replica("http://a", in_flight=1), Replica("http://b", in_flight=1)
    busy.pending_prefill = 3000.0
    assert busy.load == 1 + 3000 / PREFILL_TOKENS_PER_REQUEST and quiet.load == 1
    policy = make_policy("least-loaded")
    candidates = [Candidate(r.url, r.load) for r in (busy, quiet)]
    assert policy.choose([], candidates).url == quiet.url
