"""Where prefixcache keeps what it builds once per machine (packed weights, native kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """``$PREFIXCACHE_CACHE_DIR``, else ``$XDG_CACHE_HOME/prefixcache`` (``~/.cache/...``)."""
    if folder := os.environ.get("PREFIXCACHE_CACHE_DIR"):
        return Path(folder).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "prefixcache"
