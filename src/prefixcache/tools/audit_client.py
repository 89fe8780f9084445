"""The audit's HTTP side: prime a prefix, and time a streamed probe to its first token."""

from __future__ import annotations

import json
import time

import httpx

from prefixcache.tools.audit import AuditError


class ProbeClient:
    """Talks to ``/v1/completions`` of one server, one request at a time."""

    def __init__(self, url: str, timeout: float = 120.0) -> None:
        self.http = httpx.Client(base_url=url.rstrip("/"), timeout=timeout)
        self.model = ""

    def close(self) -> None:
        self.http.close()

    def discover_model(self, key: str | None) -> str:
        """The served model's name, from ``/v1/models``."""
        try:
            response = self.http.get("/v1/models", headers=_auth(key))
        except httpx.HTTPError as error:
            raise AuditError(f"cannot reach {self.http.base_url}: {error}") from None
        _check(response, "/v1/models")
        self.model = response.json()["data"][0]["id"]
        return self.model

    def prime(self, key: str | None, prompt: str) -> dict:
        """Send ``prompt`` (not streamed) so the server caches it; return its usage."""
        response = self._post(key, prompt, stream=False)
        _check(response, "/v1/completions")
        return response.json()["usage"]

    def ttft(self, key: str | None, prompt: str) -> float:
        """Seconds from sending ``prompt`` to the first chunk that carries a choice."""
        body = self._body(prompt, stream=True)
        start = time.perf_counter()
        first = None
        try:
            with self.http.stream("POST", "/v1/completions", json=body, headers=_auth(key)) as r:
                if r.status_code != 200:
                    r.read()
                    _check(r, "/v1/completions")
                for line in r.iter_lines():  # read to the end: the connection stays reusable
                    if first is None and _has_choice(line):
                        first = time.perf_counter() - start
        except httpx.HTTPError as error:
            raise AuditError(f"streaming from {self.http.base_url} failed: {error}") from None
        if first is None:
            raise AuditError("the stream ended without a completion chunk")
        return first

    def _post(self, key: str | None, prompt: str, stream: bool) -> httpx.Response:
        try:
            body = self._body(prompt, stream)
            return self.http.post("/v1/completions", json=body, headers=_auth(key))
        except httpx.HTTPError as error:
            raise AuditError(f"cannot reach {self.http.base_url}: {error}") from None

    def _body(self, prompt: str, stream: bool) -> dict:
        return {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": 0,
            "stream": stream,
            "ignore_eos": True,
        }


def _auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _check(response: httpx.Response, path: str) -> None:
    if response.status_code != 200:
        raise AuditError(f"{path}: HTTP {response.status_code}: {response.text[:200]}")


def _has_choice(line: str) -> bool:
    if not line.startswith("data: ") or line == "data: [DONE]":
        return False
    return bool(json.loads(line[6:]).get("choices"))
