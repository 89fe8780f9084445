"""Response ids carry their replica's instance id; the router maps one back to its replica."""

from __future__ import annotations

import pytest

import loopback
from prefixcache.protocol.response_ids import instance_of, is_instance, new_instance, response_id
from prefixcache.router.forward import error_event
from prefixcache.router.index import GlobalIndex
from prefixcache.router.metrics import RouterMetrics
from prefixcache.router.policy import make_policy
from prefixcache.router.replicas import Fleet, parse_health
from prefixcache.router.routing import PINNED_REASON, Router
from prefixcache.server.response_store import ResponseStore

HEALTH = {"status": "ok", "model": "tiny", "block_size": 4, "namespace_digest": "ab" * 32}


def test_an_id_names_its_instance_and_nothing_else_passes_for_one() -> None:
    instance = new_instance()
    assert is_instance(instance) and instance != new_instance()
    rid = response_id(instance)
    assert rid.startswith(f"resp_{instance}") and len(rid) == 5 + 8 + 24
    assert instance_of(rid) == instance
    assert response_id(instance) != rid  # the rest is random
    others = (None, 5, "", "resp_", f"resp_{instance}", "msg_0123456789abcdef")
    for other in (*others, "resp_XYZ12345abc", "resp_ABCDEF01abc"):
        assert instance_of(other) is None, other


def test_a_replicas_store_issues_ids_of_its_own_instance() -> None:
    store, other = ResponseStore(), ResponseStore()
    assert store.instance != other.instance
    assert instance_of(store.view("alpha").new_id()) == store.instance


def fleet_of(instances: dict[str, str | None]) -> Fleet:
    """A fleet whose replicas answered /health with these instance ids (no I/O)."""
    fleet = Fleet(list(instances), GlobalIndex(), loopback.AsyncClient())
    for url, instance in instances.items():
        replica = fleet.replicas[url]
        replica.identity = parse_health({**HEALTH, "instance": instance}, url)
        replica.healthy = True
    return fleet


def test_health_gives_the_instance_and_the_fleet_maps_it_to_the_replica() -> None:
    assert parse_health({**HEALTH, "instance": "0a1b2c3d"}, "http://h").instance == "0a1b2c3d"
    assert parse_health(HEALTH, "http://h").instance is None  # an older replica
    assert parse_health({**HEALTH, "instance": "../../x"}, "http://h").instance is None
    fleet = fleet_of({"http://a": "0000000a", "http://b": "0000000b", "http://c": None})
    assert fleet.by_instance("0000000b").url == "http://b"
    assert fleet.by_instance("0000000c") is None and fleet.by_instance(None) is None
    fleet.replicas["http://b"].healthy = False
    assert fleet.by_instance("0000000b") is None  # down: the request goes anywhere (404)


@pytest.mark.parametrize("policy", ["cache-aware", "round-robin", "least-loaded"])
def test_a_pinned_request_goes_to_its_replica_while_it_is_a_candidate(policy: str) -> None:
    fleet = fleet_of({"http://a": "0000000a", "http://b": "0000000b"})
    router = Router(fleet, fleet.index, make_policy(policy), RouterMetrics(fleet))
    for _ in range(3):
        ticket = router.dispatch([], pinned="http://b")
        assert ticket.url == "http://b" and ticket.choice.reason == PINNED_REASON
        router.release(ticket, ok=True)
    retried = router.dispatch([], exclude=["http://b"], pinned="http://b")
    assert retried.url == "http://a" and retried.choice.reason != PINNED_REASON


def test_a_mid_stream_error_event_has_the_routes_shape() -> None:
    openai_event = error_event("gone", "/v1/chat/completions")
    assert openai_event.startswith(b'data: {"error": ') and openai_event.endswith(b"[DONE]\n\n")
    anthropic_event = error_event("gone", "/v1/messages")
    assert anthropic_event.startswith(b'event: error\ndata: {"type": "error"')
    assert b"[DONE]" not in anthropic_event
