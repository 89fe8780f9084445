"""HTTP-side limits and their defaults: one home, read by the server, the router and their CLIs.

Sampling limits (``n``, temperature, stop strings, seed range, logprobs) are in
``protocol/sampling_limits.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_PENDING = 256  # requests in flight before new ones get HTTP 429
DEFAULT_MAX_BODY_BYTES = 4 * 2**20  # request body (413)
DEFAULT_REQUEST_READ_TIMEOUT = 30.0  # seconds to receive a request head, and then its body (408)
# Seconds an idle kept-alive connection stays open. Longer than the 5 s after which httpx
# (the router's client, and most Python clients) drops an idle connection itself: when both
# wait 5 s, a client can reuse a connection at the instant the server closes it (ReadError).
KEEP_ALIVE_TIMEOUT = 20
MAX_HEADER_BYTES = 16 * 2**10  # request line and headers together (431)
MAX_HEADERS = 100  # header fields (431)
MAX_JSON_DEPTH = 32  # nesting of arrays and objects in a body (400)
MAX_JSON_CONTAINERS = 16384  # arrays and objects in a body (400)
MAX_INT_DIGITS = 20  # digits of one JSON integer: a uint64 seed has 20 (400)
MAX_MESSAGES = 2048  # chat messages in one request (400)
MAX_CONTENT_PARTS = 256  # content parts in one message (400)
MAX_PROMPTS = 64  # prompts in one batched completion request (400)
MAX_NAME_CHARS = 256  # model, user, cache_salt (400)
MAX_RESPONSE_SCHEMA_BYTES = 64 * 2**10  # response_format's JSON schema, as compact JSON (400)
PREPARE_THREADS = 4  # requests parsed and tokenized at once, off the event loop
RETRY_AFTER_SECONDS = 1  # the Retry-After of a 429


@dataclass(frozen=True, slots=True)
class Limits:
    """The limits one server enforces (``--max-pending`` stays its own argument)."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    request_read_timeout: float = DEFAULT_REQUEST_READ_TIMEOUT
    max_pending_per_tenant: int | None = None  # None: half of max_pending

    def tenant_share(self, max_pending: int) -> int:
        """Engine requests one tenant may have in flight: never all of ``max_pending``."""
        if self.max_pending_per_tenant is not None:
            return self.max_pending_per_tenant
        return max(1, max_pending // 2)
