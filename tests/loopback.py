"""httpx's calls for the servers the tests start, with one TLS context a process.

A fresh httpx client parses certifi's CA bundle (~28 ms of CPU, even for plain http): the
suite's polls every 20 ms spent ~100 s of CPU a run on it. These are httpx's own functions
and classes, given the context ``prefixcache.protocol.loopback_http`` builds once.
"""

from __future__ import annotations

from functools import partial

import httpx

from prefixcache.protocol import loopback_http

get = loopback_http.get  # the product's own
tls_context = loopback_http.tls_context
post = partial(httpx.post, verify=tls_context())
stream = partial(httpx.stream, verify=tls_context())
request = partial(httpx.request, verify=tls_context())
Client = partial(httpx.Client, verify=tls_context())
AsyncClient = partial(httpx.AsyncClient, verify=tls_context())
