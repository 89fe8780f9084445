"""A soak: valid, invalid, oversized, disconnecting and slow clients of three tenants, mixed,
at a concurrency above --max-pending. Afterwards no 5xx was ever sent, every block is back,
the invariants hold, memory grew by less than a bound, and the server still answers right.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter
from pathlib import Path

import httpx

import loopback
from engine_fixtures import assert_pool_clean, tiny_engine
from prefixcache.protocol.auth import Tenants
from prefixcache.protocol.limits import Limits
from server_fixtures import running_server, wait_idle, write_key_file

REQUESTS = int(os.environ.get("PREFIXCACHE_SOAK_REQUESTS", "2000"))
CONCURRENCY = 24  # twice --max-pending
MAX_PENDING = 12
# The read deadline is short so slow clients are cut off quickly, yet long enough that a
# client which connects while this one process (server and clients) is busy still sends its
# head in time on a loaded two-core machine.
LIMITS = Limits(max_body_bytes=128 * 1024, request_read_timeout=1.5)
RSS_GROWTH_BOUND = 64 * 2**20  # bytes, measured after a warm-up
KEYS = ["sk-alpha", "sk-beta", "sk-private"]
PROMPTS = [f"Soak document {i}: the ferry leaves the harbour at dawn. " * 3 for i in range(6)]
FINAL = {"model": "tiny", "prompt": "The final check", "max_tokens": 6, "temperature": 0,
         "ignore_eos": True}  # fmt: skip


def rss() -> int:
    """Resident set size of this process (server and clients), in bytes."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def _headers(key: str) -> dict:
    return {"authorization": f"Bearer {key}", "content-type": "application/json"}


async def valid(http: httpx.AsyncClient, rng: random.Random, key: str) -> str:
    """A well-formed request (chat or completions, streamed or not, one or two prompts)."""
    body = {"model": "tiny", "max_tokens": rng.randrange(1, 8), "ignore_eos": True}
    if rng.random() < 0.5:
        body["messages"] = [{"role": "user", "content": rng.choice(PROMPTS)}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = rng.choice(PROMPTS) if rng.random() < 0.7 else rng.sample(PROMPTS, 2)
        path = "/v1/completions"
    if rng.random() < 0.4:
        async with http.stream("POST", path, json={**body, "stream": True},
                               headers=_headers(key)) as reply:  # fmt: skip
            text = await reply.aread()
            assert reply.status_code != 200 or text.endswith(b"data: [DONE]\n\n")
            return str(reply.status_code)
    return str((await http.post(path, json=body, headers=_headers(key))).status_code)


async def invalid(http: httpx.AsyncClient, rng: random.Random, key: str) -> str:
    bodies = [
        b"{not json", b'{"model": "tiny", "prompt": "\\ud800 hi"}', b"[1, 2]",
        b'{"model": "tiny", "prompt": "x", "temperature": NaN}',
        b'{"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}',
        b'{"model": "other", "prompt": "x"}', b'{"model": "tiny", "prompt": [-3]}',
        b'{"model": "tiny", "prompt": "x", "n": 99}', b"\xff\xfe\xfd",
    ]  # fmt: skip
    headers = _headers(key if rng.random() < 0.8 else "sk-wrong")
    reply = await http.post("/v1/completions", content=rng.choice(bodies), headers=headers)
    return str(reply.status_code)


async def raw(port: int, data: bytes, then: str) -> str:
    """A hand-made request: ``then`` is "read" (send it, wait for the reply), "close"
    (send it, leave at once) or "drip" (half of it, then a byte per 50 ms: slower than
    the read deadline); the reply's status, or what happened instead."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data[: len(data) // 2] if then == "drip" else data)
        await writer.drain()
        if then == "close":
            return "closed"
        line = b""
        for byte in data[len(data) // 2 :] if then == "drip" else b"":
            try:  # waiting for a reply between two bytes
                line = await asyncio.wait_for(reader.readline(), timeout=0.05)
                break
            except TimeoutError:
                writer.write(bytes([byte]))
        line = line or await asyncio.wait_for(reader.readline(), timeout=30)
        return line.split()[1].decode() if line else "eof"
    except (ConnectionError, asyncio.IncompleteReadError):
        return "reset"
    finally:
        writer.close()


def _raw_request(key: str, body: bytes, length: int | None = None) -> bytes:
    """A completions request by hand; ``length`` (the declared one) may lie."""
    length = len(body) if length is None else length
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    )
    return head.encode() + body


def _chunked_request(key: str, size: int) -> bytes:
    """A chunked body of ``size`` bytes (no length declared), unterminated."""
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    )
    return head.encode() + b"%x\r\n%s\r\n" % (size, b" " * size)


async def one(http: httpx.AsyncClient, port: int, rng: random.Random) -> tuple[str, str]:
    """One client of a random kind: (kind, what it saw)."""
    key = rng.choice(KEYS)
    kind = rng.choices(
        ["valid", "invalid", "oversized", "disconnect", "gone", "slow"], [50, 20, 8, 10, 6, 6]
    )[0]
    if kind == "valid":
        return kind, await valid(http, rng, key)
    if kind == "invalid":
        return kind, await invalid(http, rng, key)
    body = json.dumps({"model": "tiny", "prompt": rng.choice(PROMPTS), "max_tokens": 30,
                       "ignore_eos": True, "stream": kind == "disconnect"}).encode()  # fmt: skip
    if kind == "oversized":  # declared (only the head is sent), or chunked past the limit
        if rng.random() < 0.5:
            return kind, await raw(port, _raw_request(key, b"", LIMITS.max_body_bytes + 1), "read")
        chunked = _chunked_request(key, LIMITS.max_body_bytes + 1)
        return "oversized chunked", await raw(port, chunked, "read")
    if kind == "disconnect":  # streams, reads the first event, goes away
        async with http.stream("POST", "/v1/completions", content=body,
                               headers=_headers(key)) as reply:  # fmt: skip
            async for _ in reply.aiter_bytes():
                break
            return kind, f"{reply.status_code} closed"
    if kind == "gone":  # sends the request and leaves before any reply
        return kind, await raw(port, _raw_request(key, body), "close")
    return kind, await raw(port, _raw_request(key, body), "drip")


async def soak(url: str, count: int, seed: int) -> Counter:
    rng = random.Random(seed)
    port = int(url.rsplit(":", 1)[1])
    gate = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    async with loopback.AsyncClient(base_url=url, timeout=60, limits=limits) as http:

        async def limited(index: int) -> tuple[str, str]:
            async with gate:
                return await one(http, port, random.Random(rng.random() + index))

        return Counter(await asyncio.gather(*(limited(i) for i in range(count))))


def test_soak_mixed_clients_leave_the_server_whole(tmp_path):
    engine = tiny_engine(num_kv_blocks=256, max_num_seqs=8)
    tenants = Tenants.from_file(write_key_file(tmp_path))
    with running_server(engine, tenants, max_pending=MAX_PENDING, limits=LIMITS) as (url, state):
        alpha = _headers("sk-alpha")
        expected = loopback.post(url + "/v1/completions", json=FINAL, headers=alpha).json()
        asyncio.run(soak(url, 100, seed=1))  # warm-up: allocator arenas, caches, threads
        wait_idle(state)
        before, started = rss(), time.monotonic()
        seen = asyncio.run(soak(url, REQUESTS, seed=2))
        took = time.monotonic() - started
        wait_idle(state)
        grew = rss() - before
        final = loopback.post(url + "/v1/completions", json=FINAL, headers=alpha).json()
        wait_idle(state)  # nothing read, prepared or run: every tenant's share is back
        held = {t: state.in_flight.held(t) for t in ("alpha", "beta", "private")}
    print(f"soak: {REQUESTS} requests in {took:.1f} s; RSS grew {grew / 2**20:.1f} MiB")
    print("soak:", sorted(seen.items()))
    statuses = Counter(s for (_, outcome) in seen for s in outcome.split()[:1])
    assert not [s for s in statuses if s.startswith("5")], statuses  # never a 5xx
    by_kind = {kind: {o for (k, o), _ in seen.items() if k == kind} for kind, _ in seen}
    assert by_kind["valid"] <= {"200", "429"} and "200" in by_kind["valid"]
    assert "429" in by_kind["valid"]  # the concurrency was above --max-pending
    assert by_kind["invalid"] <= {"400", "401", "404", "429"}  # a tenant at its share: 429
    assert by_kind["oversized"] <= {"413", "429", "reset"} and "413" in by_kind["oversized"]
    # 413 once past the limit, or 408: the read deadline (1.5 s here) counts the server's
    # reading too, and this process's own clients share its event loop and GIL (seen once)
    assert by_kind.get("oversized chunked", set()) <= {"413", "408", "429", "reset"}
    assert by_kind["slow"] <= {"408", "429"} and "408" in by_kind["slow"]
    assert by_kind["disconnect"] <= {"200 closed", "429 closed"}
    assert final["choices"][0]["text"] == expected["choices"][0]["text"]
    assert held == {"alpha": 0, "beta": 0, "private": 0} and state.pool.busy == 0
    assert_pool_clean(engine)
    assert grew < RSS_GROWTH_BOUND, f"RSS grew {grew / 2**20:.1f} MiB"
