"""Server limits and their defaults: one home, read by the app and by `prefixcache serve`."""

from __future__ import annotations

DEFAULT_MAX_PENDING = 256  # requests in flight before new ones get HTTP 429
