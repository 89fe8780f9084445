"""Cache-control classes a client may ask for, and how long each keeps a prefix (seconds).

One home for the mapping: Anthropic's ``cache_control.ttl`` ("5m", "1h") names a class here.
"""

from __future__ import annotations

RETENTION_SECONDS = {  # class -> seconds a marked prefix stays cached
    "5m": 300,
    "1h": 3600,
}
ANTHROPIC_TTLS = ("5m", "1h")  # the classes Anthropic's cache_control.ttl may name
ANTHROPIC_DEFAULT_TTL = "5m"
MAX_ANTHROPIC_BREAKPOINTS = 4  # cache_control blocks per request, as Anthropic allows
