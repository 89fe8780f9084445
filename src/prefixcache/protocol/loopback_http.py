"""httpx calls to our own servers (health and readiness polls) with one TLS context a process.

httpx builds a TLS context from certifi's CA bundle for every client it makes, ``httpx.get``
included: ~28 ms of CPU each (measured), even for a plain-http URL, so a loop polling every
20 ms spent most of a core on it. The context is built here once, as httpx builds it.
"""

from __future__ import annotations

import ssl
from functools import cache

import httpx


@cache
def tls_context() -> ssl.SSLContext:
    """httpx's default context (certifi's CAs, ``SSL_CERT_FILE`` honoured), built once."""
    return httpx.create_ssl_context()


def get(url: str, **options: object) -> httpx.Response:
    """``httpx.get`` with the process's TLS context."""
    return httpx.get(url, verify=tls_context(), **options)
