"""Small facts and helpers every layer shares; one home, no torch, no I/O."""

from __future__ import annotations

DEFAULT_BLOCK_SIZE = 16  # tokens per KV block, everywhere a default is needed
TOKEN_BYTES = 4  # a token id is stored as a little-endian uint32 in every key and digest


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of ``b`` hold ``a`` tokens."""
    return -(-a // b)


def require(condition: bool, message: str) -> None:
    """Raise AssertionError with ``message`` (unlike ``assert``, never stripped)."""
    if not condition:
        raise AssertionError(message)
