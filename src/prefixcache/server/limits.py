"""Server limits and their defaults: one home, read by the app and by `prefixcache serve`.

Sampling limits (``n``, temperature, stop strings, seed range, logprobs) live with
``SamplingParams`` in ``engine/sampling.py``; these are the HTTP-side ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prefixcache.engine.tokenizer import Tokenizer

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


def longest_token_chars(tokenizer: Tokenizer) -> int:
    """Characters of the longest vocabulary entry: no token covers more text than that."""
    return max(len(token) for token in tokenizer.backend.get_vocab(with_added_tokens=True))


def max_prompt_chars(tokenizer: Tokenizer, context: int) -> int:
    """Characters above which a prompt cannot fit ``context`` tokens, checked before tokenizing.

    Each token covers at most ``longest_token_chars`` characters (a byte-level entry is at
    least as long as the text it stands for), so this never refuses a prompt that fits.
    """
    return context * longest_token_chars(tokenizer)
