"""Prompt-caching controls of the client APIs, as the cache's retention marks (``Keep``).

One home for the names: OpenAI's ``prompt_cache_retention`` values and Anthropic's
``cache_control`` TTLs, each a retention class and how long it keeps a prompt cached.
"""

from __future__ import annotations

from prefixcache.cache.retention import Keep

# OpenAI documents in-memory retention as 5-10 minutes of inactivity, refreshed on use
OPENAI_RETENTION = {"in_memory": 300, "24h": 86400}  # class -> seconds
OPENAI_ALIASES = {"in-memory": "in_memory"}
ANTHROPIC_TTLS = {"5m": 300, "1h": 3600}  # cache_control ttl -> seconds
ANTHROPIC_DEFAULT_TTL = "5m"
MAX_ANTHROPIC_BREAKPOINTS = 4  # cache_control blocks per request, as Anthropic allows
MAX_CACHE_KEY_CHARS = 256  # prompt_cache_key
CACHE_KEY_LOG_CHARS = 12  # hex digits of a key's id in the access log


def openai_retention_class(value: object) -> str:
    """``prompt_cache_retention`` as its class; ValueError listing the allowed values."""
    name = OPENAI_ALIASES.get(value, value) if isinstance(value, str) else None
    if name not in OPENAI_RETENTION:
        allowed = ", ".join(repr(v) for v in [*OPENAI_RETENTION, *OPENAI_ALIASES])
        raise ValueError(f"must be one of {allowed}, got {_short(value)}")
    return name


def openai_keeps(retention_class: str | None, prompt_length: int) -> tuple[Keep, ...]:
    """The whole prompt kept for the class's time; none without a class (automatic only)."""
    if retention_class is None:
        return ()
    return (Keep(prompt_length, OPENAI_RETENTION[retention_class], retention_class),)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
