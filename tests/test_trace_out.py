"""`--trace-out`: a captured trace replays to the hit rate the server reported."""

from __future__ import annotations

import json

import loopback
from engine_fixtures import tiny_engine
from prefixcache.protocol.auth import Tenants
from prefixcache.server.trace_out import TraceWriter
from prefixcache.sim.replay import replay
from prefixcache.sim.traces import load_trace
from server_fixtures import running_server, wait_idle, write_key_file

SYSTEMS = ["Heron ferry desk, brief answers only. " * 4, "Lynx rail help: one sentence. " * 5]


def chat(url: str, key: str, system: str, question: str) -> None:
    body = {
        "model": "tiny",
        "max_tokens": 3,
        "temperature": 0,
        "ignore_eos": True,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
    }
    headers = {"Authorization": f"Bearer {key}"}
    reply = loopback.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert reply.status_code == 200, reply.text


def test_a_captured_trace_replays_to_the_servers_hit_rate(tmp_path):
    engine = tiny_engine(num_kv_blocks=400, block_size=4)
    tenants = Tenants.from_file(write_key_file(tmp_path))
    path = tmp_path / "trace.jsonl"
    trace = TraceWriter(path, engine.manager)
    engine.on_retired.append(trace.record)
    with running_server(engine, tenants) as (url, state):
        for index in range(12):  # two tenants, two system prompts, sequential
            key = ("sk-alpha", "sk-beta")[index % 2]
            chat(url, key, SYSTEMS[index % 3 % 2], f"Question number {index}?")
        wait_idle(state)
    trace.close()
    stats = engine.manager.stats
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 12 and all(set(line) == {*lines[0]} for line in lines)
    assert "token_ids" not in lines[0] and lines[0]["block_size"] == 4
    replayed = replay(load_trace(path), engine.manager.num_blocks)
    assert replayed.tokens == stats.queries and replayed.hit_tokens == stats.hits > 0
    engine.close()
