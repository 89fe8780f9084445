"""``prefixcache explain --served REQUEST_ID --url URL``: what a server recorded of a request
it finished (``GET /admin/requests/{id}``, admin key): its cache hit, its first token, and
why it waited before it ran, one phrase per reason naming the flag or cause."""

from __future__ import annotations

import argparse
import sys
from urllib.parse import quote

import httpx

from prefixcache.tools.top import admin_key, with_scheme
from prefixcache.tools.top.scrape import Client

TIMEOUT = 10.0
WHY = {  # the scheduler's WAIT_REASONS, as causes
    "step_time": "because steps were full at the step target (--step-target-ms)",
    "priority": "because higher-priority requests went first (priority)",
    "seats": "because all --max-num-seqs seats were running",
    "memory": "because the KV pool had no room (--kv-cache-blocks, --kv-cache-bytes)",
    "tier_load": "while its blocks were loading from the KV tier",
    "fairness": "because its tenant was over its cache share (--fair-cache)",
}


class ServedError(Exception):
    """One line for the user; exit status 2."""


def run_served(args: argparse.Namespace) -> int:
    """Fetch the record and print the explanation (0); one line on stderr and 2 if not."""
    try:
        record = fetch_record(with_scheme(args.url), args.served, admin_key(args))
    except ServedError as error:
        print(f"prefixcache explain: {error}", file=sys.stderr)
        return 2
    print("\n".join(served_lines(record)))
    return 0


def fetch_record(url: str, request_id: str, key: str | None) -> dict:
    """The server's record of ``request_id``; ``ServedError`` saying why not."""
    base = f"{url.rstrip('/')}/admin/requests/"
    where = base + quote(request_id, safe="")
    client = Client(key, timeout=TIMEOUT)
    try:
        reply = client.http.get(where)
    except httpx.HTTPError as error:
        raise ServedError(f"cannot reach {url}: {type(error).__name__} {error}") from None
    finally:
        client.close()
    if reply.status_code in (401, 403):
        raise ServedError(client.refused(base + "{request_id}", reply.status_code))
    body = _json(reply)
    if reply.status_code != 200:
        error = body.get("error") if isinstance(body, dict) else None
        message = error.get("message") if isinstance(error, dict) else None
        raise ServedError(message or f"{where}: HTTP {reply.status_code}")
    if not isinstance(body, dict) or "queue_seconds" not in body:
        raise ServedError(f"{where}: not a prefixcache server's request record")
    return body


def _json(reply: httpx.Response) -> object:
    try:
        return reply.json()
    except ValueError:
        return None


def served_lines(record: dict) -> list[str]:
    """Two lines: the cache hit and first token; the waits by reason."""
    return [_hit_line(record), _wait_line(record.get("queue_seconds") or {})]


def _hit_line(record: dict) -> str:
    """``request X: N prompt tokens, M served from cache (pool P, tier T); first token ...``"""
    prompts = record.get("prompts", 1)
    across = f" over {prompts} prompts" if prompts > 1 else ""
    ttft = record.get("ttft_seconds")
    first = "no token came" if ttft is None else f"first token after {ttft:.2f} s"
    status = record.get("status", "ok")
    ended = "" if status == "ok" else f"; it ended {status}"
    return (
        f"request {record['request_id']}: {record['prompt_tokens']:,} prompt tokens{across}, "
        f"{record['cached_tokens']:,} served from cache (pool {record['pool_tokens']:,}, "
        f"tier {record['tier_tokens']:,}); {first}{ended}"
    )


def _wait_line(waits: dict[str, float]) -> str:
    """``waited T s before it ran: t1 s because ..., t2 s ...``, or that it did not."""
    waits = {reason: s for reason, s in waits.items() if round(s, 2) > 0}
    if not waits:
        return "it did not wait"
    ordered = sorted(waits.items(), key=lambda item: -item[1])
    parts = [f"{s:.2f} s {WHY.get(reason, f'({reason})')}" for reason, s in ordered]
    return f"waited {sum(waits.values()):.2f} s before it ran: " + ", ".join(parts)
