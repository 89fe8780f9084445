"""The tier's vocabulary: block format, statistics, errors and the backend interface.

A tier is a second-level block store keyed by the portable 32-byte chain digest. It deals
in bytes only; the engine turns KV tensors into bytes and back (``BlockFormat`` says how).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

DIGEST_BYTES = 32
REJECT_REASONS = (
    "truncated",
    "magic",
    "version",
    "digest",
    "namespace",
    "dtype",
    "layout",
    "shape",
    "length",
    "unsealed",
    "key",
    "forged",
)
# Reasons that mean the stored value is damaged, forged or not sealed for us (not merely
# another engine's format): drop it, so the block can be written again.
CORRUPT_REASONS = frozenset({"truncated", "magic", "digest", "length", "unsealed", "key", "forged"})


class BlockFormat(NamedTuple):
    """What one block's KV bytes mean; a stored value must match it exactly to load."""

    namespace_digest: bytes  # root of the digest chain: model, revision, dtype, block size
    dtype: str  # e.g. "float32"
    layout: str  # axis names of ``shape``, e.g. "layer,kv,token,kv_head,head_dim"
    shape: tuple[int, ...]  # e.g. (30, 2, 16, 3, 64)
    itemsize: int  # bytes per element

    @property
    def payload_bytes(self) -> int:
        """Size of one block's KV bytes."""
        return math.prod(self.shape) * self.itemsize


@dataclass(slots=True)
class TierStats:
    """Counters of one ``TierClient``; ``rejected`` counts stored values refused, by reason."""

    lookups: int = 0
    hit_blocks: int = 0
    miss_blocks: int = 0
    loads: int = 0
    load_seconds: float = 0.0
    bytes_read: int = 0
    writes: int = 0
    bytes_written: int = 0
    writes_dropped: int = 0
    errors: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    evictions: int = 0
    rejected_files: dict[str, int] = field(default_factory=dict)  # the backend's, by reason

    def as_dict(self) -> dict[str, object]:
        """A plain copy, safe to serialize or compare."""
        out: dict[str, object] = {name: getattr(self, name) for name in self.__slots__}
        out["rejected"] = dict(self.rejected)
        out["rejected_files"] = dict(self.rejected_files)
        return out


class TierError(OSError):
    """The backend could not be reached or failed an I/O operation."""


class TierValueError(ValueError):
    """A stored value does not decode to a block this engine would compute."""

    def __init__(self, reason: str, detail: str = "") -> None:
        assert reason in REJECT_REASONS, reason
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class KVTier(ABC):
    """A second-level block store: values keyed by 32-byte digest, stored once, read many.

    Values are opaque bytes here (``codec`` gives them meaning). Every method may be called
    from several threads at once; failures to reach the store raise ``TierError``.
    """

    medium: str = "tier"  # name used in KV events: "disk" or "redis"
    evictions: int = 0  # blocks this process removed to respect a size cap

    @property
    def rejected_files(self) -> dict[str, int]:
        """Stored entries refused as unsound, by reason (the disk tier's files); default none."""
        return {}

    @abstractmethod
    def present(self, digests: Sequence[bytes]) -> int:
        """How many leading ``digests`` are stored, stopping at the first absent one.

        One round trip to the store. A positive answer is a hint, not a promise: the
        value may be evicted before ``get`` reads it.
        """

    @abstractmethod
    def get(self, digests: Sequence[bytes]) -> list[bytes | None]:
        """The stored value of each digest, or None where absent, in one round trip."""

    @abstractmethod
    def put(
        self, digest: bytes, value: bytes, depth: int, ttl_seconds: float | None = None
    ) -> bool:
        """Store ``value`` under ``digest``; False if it was already present or not written.

        ``depth`` is the block's index in its chain: eviction prefers deep blocks, so
        shared shallow prefixes outlive long tails. ``ttl_seconds``: the block is retained
        that long (the cache's retention mark); the store keeps it at least as long as it can.
        """

    def retain(self, digest: bytes, ttl_seconds: float) -> bool:
        """Keep a stored block at least ``ttl_seconds`` more (never shorter than it was);
        False if it is not stored. Default: nothing to extend."""
        return False

    def discard(self, digests: Sequence[bytes]) -> None:  # noqa: B027 (optional hook)
        """Remove damaged values so a later ``put`` can replace them; default: no-op."""

    @abstractmethod
    def close(self) -> None:
        """Release files, sockets and locks; the tier is unusable afterwards."""
