"""The view's HTTP side: a server's ``/health``, ``/metrics`` and ``/admin/prefixes``, and a
router's ``/admin/replicas``, with short timeouts. A refused key is a ``TopError``; a server
that does not answer is ``Down`` (the view shows it and asks again next time)."""

from __future__ import annotations

import time

import httpx

from prefixcache.tools.top.samples import Samples, parse

KEY_HELP = "pass --api-key KEY or set PREFIXCACHE_API_KEY"
PREFIX_ROWS = 8


class TopError(Exception):
    """What stops the view: one line for the user, exit status 2."""


class Down(Exception):
    """A server did not answer (or not as a prefixcache server would): the reason, without
    its URL."""


class Client:
    """One HTTP client for every server the view reads, with the admin key if given."""

    def __init__(self, key: str | None, timeout: float) -> None:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.keyed = key is not None
        self.http = httpx.Client(headers=headers, timeout=timeout, follow_redirects=False)

    def close(self) -> None:
        self.http.close()

    def health(self, url: str) -> dict:
        """``/health``'s body (a router answers 503 with one while no replica is up)."""
        body = _json(self._get(url, "/health"))
        if not isinstance(body, dict):
            raise Down("/health: not a prefixcache server's")
        return body

    def metrics(self, url: str) -> Samples:
        """``/metrics`` as samples (admin key)."""
        response = self._get(url, "/metrics", admin=True)
        try:
            return parse(response.text, time.monotonic())
        except ValueError as error:
            raise Down(f"/metrics: not Prometheus text ({error})") from None

    def prefixes(self, url: str) -> list[dict]:
        """Where the replica's cached chains fork and end (admin key); [] from a server
        without ``/admin/prefixes``."""
        try:
            body = _json(self._get(url, f"/admin/prefixes?limit={PREFIX_ROWS}", admin=True))
        except Down:
            return []
        rows = body.get("prefixes") if isinstance(body, dict) else None
        return [row for row in rows if isinstance(row, dict)] if isinstance(rows, list) else []

    def replicas(self, url: str) -> list[str]:
        """A router's replicas' URLs, in its order (``/admin/replicas``, admin key)."""
        body = _json(self._get(url, "/admin/replicas", admin=True))
        entries = body.get("replicas") if isinstance(body, dict) else None
        if not isinstance(entries, list):
            raise Down("/admin/replicas: not a prefixcache router's")
        return [r["url"] for r in entries if isinstance(r, dict) and isinstance(r.get("url"), str)]

    def _get(self, url: str, path: str, admin: bool = False) -> httpx.Response:
        """A GET that answered 2xx (or /health's 503); ``TopError`` for a refused key."""
        try:
            response = self.http.get(url + path)
        except httpx.HTTPError as error:
            raise Down(f"{type(error).__name__}: {error}".rstrip(": ")) from None
        if admin and response.status_code in (401, 403):
            raise TopError(self.refused(url + path.split("?")[0], response.status_code))
        if response.status_code >= 400 and not (path == "/health" and response.status_code == 503):
            raise Down(f"{path}: HTTP {response.status_code}")
        return response

    def refused(self, where: str, status: int) -> str:
        """One line on why ``where`` refused this client's key (HTTP 401 or 403)."""
        if status == 401 and not self.keyed:
            return f"{where} needs an admin key (HTTP 401): {KEY_HELP}"
        if status == 401:
            return f"{where} does not know this key (HTTP 401): pass an admin's key"
        return f"{where} needs an admin key; this key's tenant is not an admin (HTTP 403)"


def _json(response: httpx.Response) -> object:
    """The response's JSON body; ``Down`` if it is not JSON."""
    try:
        return response.json()
    except ValueError:
        raise Down(f"{response.request.url.path}: not JSON") from None
