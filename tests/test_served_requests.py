"""``GET /admin/requests/{id}`` and ``prefixcache explain --served``: a real server on loopback
records its finished requests (counts, times, waits by reason; never text), the last N only."""

from __future__ import annotations

import json
import logging
import re
import threading

import httpx
import pytest

import loopback
from engine_fixtures import tiny_engine
from prefixcache.cli import main
from prefixcache.engine.config import DEFAULT_STEP_TARGET_MS
from prefixcache.engine.scheduler import WAIT_REASONS
from prefixcache.protocol.auth import Tenants
from prefixcache.server.recent_requests import RecentRequests
from prefixcache.tools.explain_served import WHY, served_lines
from server_fixtures import running_server, write_key_file

ADMIN = {"authorization": "Bearer sk-alpha"}
BETA = {"authorization": "Bearer sk-beta"}
WORD = "zanzibarquux"  # a prompt word no record may contain
RECORD_KEYS = {
    "request_id", "tenant", "endpoint", "status", "priority", "prompts", "prompt_tokens",
    "cached_tokens", "pool_tokens", "tier_tokens", "completion_tokens", "ttft_seconds",
    "total_seconds", "queue_seconds",
}  # fmt: skip


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One seat, a step target (waits are timed only then), API keys (alpha is an admin)."""
    keys = write_key_file(tmp_path_factory.mktemp("keys"))
    engine = tiny_engine(num_kv_blocks=256, max_num_seqs=1, step_target_ms=DEFAULT_STEP_TARGET_MS)
    with running_server(engine, Tenants.from_file(keys)) as (url, state):
        yield url, state


def complete(url: str, words: str, max_tokens: int = 24) -> str:
    """A completion's response id."""
    body = {"model": "tiny", "prompt": f"{WORD} {words}", "max_tokens": max_tokens}
    reply = loopback.post(url + "/v1/completions", json=body, headers=ADMIN, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["id"]


def together(url: str) -> list[str]:
    """Two completions sent at once: with one seat, one waits for the other's."""
    ids: list[str] = []
    start = threading.Barrier(2)

    def one(words: str) -> None:
        start.wait()
        ids.append(complete(url, words))

    threads = [threading.Thread(target=one, args=(w,)) for w in ("one two", "three four")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return ids


def logged_waits(caplog: pytest.LogCaptureFixture, request_id: str) -> dict[str, float]:
    """The ``waited=`` field of ``request_id``'s access-log line, by reason."""
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith(request_id)]
    found = re.search(r" waited=(\S+)", line)
    if found is None:
        return {}
    pairs = (part.split(":") for part in found.group(1).split(","))
    return {reason: float(seconds.rstrip("s")) for reason, seconds in pairs}


def test_the_record_says_what_the_access_log_said_and_no_text(served, caplog):
    url, _ = served
    caplog.set_level(logging.INFO, logger="prefixcache.server")
    ids = together(url)
    records = {}
    for request_id in ids:
        reply = loopback.get(f"{url}/admin/requests/{request_id}", headers=ADMIN)
        assert reply.status_code == 200, reply.text
        assert WORD not in reply.text and "token_ids" not in reply.text
        records[request_id] = record = reply.json()
        assert set(record) == RECORD_KEYS
        assert record["request_id"] == request_id and record["tenant"] == "alpha"
        assert record["endpoint"] == "completions" and record["status"] == "ok"
        assert record["prompt_tokens"] > 0 and record["completion_tokens"] == 24
        assert record["pool_tokens"] + record["tier_tokens"] == record["cached_tokens"]
        assert 0 < record["ttft_seconds"] <= record["total_seconds"]
        logged = logged_waits(caplog, request_id)
        assert set(logged) == set(record["queue_seconds"])
        for reason, seconds in record["queue_seconds"].items():
            assert abs(seconds - logged[reason]) <= 0.006, (reason, seconds, logged)
    waited = [r["queue_seconds"].get("seats", 0.0) for r in records.values()]
    assert max(waited) > 0, records  # the later one waited for the only seat


def test_admin_keys_only_and_unknown_ids_are_404(served):
    url, _ = served
    path = url + "/admin/requests/chatcmpl-nothere"
    assert loopback.get(path).status_code == 401
    assert loopback.get(path, headers=BETA).status_code == 403
    missing = loopback.get(path, headers=ADMIN)
    assert missing.status_code == 404
    error = missing.json()["error"]
    assert "chatcmpl-nothere" in error["message"] and "only the last 1024" in error["message"]
    assert httpx.head(path, headers=ADMIN).status_code == 404
    schema = loopback.get(url + "/openapi.json", headers=ADMIN).json()
    declared = schema["paths"]["/admin/requests/{request_id}"]["get"]["responses"]
    assert {"200", "401", "403", "404"} <= set(declared)


def test_only_the_last_n_are_kept(served):
    url, state = served
    state.recent = RecentRequests(limit=2)
    try:
        first, second, third = (complete(url, w, max_tokens=2) for w in ("a", "b", "c"))
        gone = loopback.get(f"{url}/admin/requests/{first}", headers=ADMIN)
        assert gone.status_code == 404 and "only the last 2 " in gone.json()["error"]["message"]
        for kept in (second, third):
            assert loopback.get(f"{url}/admin/requests/{kept}", headers=ADMIN).status_code == 200
    finally:
        state.recent = RecentRequests()


def test_explain_served_names_the_reasons(served, capsys, monkeypatch):
    url, state = served
    ids = together(url)
    waits = {i: state.recent.get(i)["queue_seconds"] for i in ids}
    later = max(ids, key=lambda i: waits[i].get("seats", 0.0))
    status = main(["explain", "--served", later, "--url", url, "--api-key", "sk-alpha"])
    out = capsys.readouterr().out.splitlines()
    assert status == 0
    assert out[0].startswith(f"request {later}: ") and "served from cache (pool " in out[0]
    assert "first token after " in out[0]
    assert out[1].startswith("waited ") and WHY["seats"] in out[1]
    monkeypatch.setenv("PREFIXCACHE_API_KEY", "sk-alpha")
    assert main(["explain", "--served", "chatcmpl-nothere", "--url", url]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "chatcmpl-nothere" in err[0] and "only the last" in err[0]
    monkeypatch.setenv("PREFIXCACHE_API_KEY", "sk-beta")
    assert main(["explain", "--served", later, "--url", url]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not an admin (HTTP 403)" in err[0]


def test_explain_needs_a_and_b_or_served(capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["explain", "only-a.json"])
    assert stopped.value.code == 2 and "(or --served)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stopped:
        main(["explain", "a.json", "--served", "chatcmpl-x"])
    assert stopped.value.code == 2 and "not both" in capsys.readouterr().err


def test_every_wait_reason_has_its_phrase_and_no_wait_says_so():
    assert set(WHY) == set(WAIT_REASONS)
    record = {
        "request_id": "chatcmpl-1a2b", "prompts": 1, "prompt_tokens": 1520,
        "cached_tokens": 1488, "pool_tokens": 1488, "tier_tokens": 0, "ttft_seconds": 0.62,
        "status": "ok", "queue_seconds": {"seats": 0.12, "step_time": 0.3},
    }  # fmt: skip
    hit, wait = served_lines(record)
    assert hit == (
        "request chatcmpl-1a2b: 1,520 prompt tokens, 1,488 served from cache "
        "(pool 1,488, tier 0); first token after 0.62 s"
    )
    assert wait == f"waited 0.42 s before it ran: 0.30 s {WHY['step_time']}, 0.12 s {WHY['seats']}"
    assert served_lines({**record, "queue_seconds": {"memory": 0.001}})[1] == "it did not wait"
    assert json.dumps(WHY).count("--") >= 4  # the flags are named
