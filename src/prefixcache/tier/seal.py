"""Sealing keys for tier values: AES-256-GCM, one key per tenant salt, from the tenant secret.

Whoever can read the store (Redis, the tier folder) holds the K/V of every cached prompt,
and whoever can write it could change every replica's answers. So every stored value is
sealed (``codec``): encrypted and authenticated under a key derived (HKDF-SHA256) from the
tenant secret and the request's cache salt, with the value's header (block digest,
namespace digest, layout) as associated data. A value can then be neither read, nor
altered, nor moved to another digest's key, and one tenant's key opens none of another's.

A secret's key id (8 bytes, the same for all its tenants) is stored in the clear, so a
reader tells a value of another secret from a forgery without trying every key.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

KEY_BYTES = 32  # AES-256
KEY_ID_BYTES = 8
NONCE_BYTES = 12  # random per value: < 2^32 values per key keeps collisions negligible
TAG_BYTES = 16
MAX_CACHED_KEYS = 4096  # derived per-salt keys kept (one HKDF each, ~20 us, otherwise)
ROOT_INFO = b"prefixcache tier root v1"
KEY_ID_INFO = b"prefixcache tier key id v1"
SALT_KEY_INFO = b"prefixcache tier key v1\x00"


def _derive(material: bytes, info: bytes, length: int = KEY_BYTES) -> bytes:
    """HKDF-SHA256 of ``material`` for one purpose (``info``)."""
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=info).derive(material)


def _salt_info(salt: str | None) -> bytes:
    """The salt, typed: no salt and an empty salt never share a key."""
    return SALT_KEY_INFO + (b"\x00" if salt is None else b"\x01" + salt.encode("utf-8"))


@dataclass(frozen=True, slots=True)
class SealKey:
    """One tenant salt's key under one secret: what seals and opens its values."""

    key_id: bytes
    aead: AESGCM


class SecretKeys:
    """The per-salt keys of one secret, derived on first use and kept (bounded)."""

    def __init__(self, secret: bytes) -> None:
        self.key_id = _derive(secret, KEY_ID_INFO, KEY_ID_BYTES)
        self._root = _derive(secret, ROOT_INFO)
        self._keys: OrderedDict[str | None, SealKey] = OrderedDict()
        self._lock = threading.Lock()

    def for_salt(self, salt: str | None) -> SealKey:
        """The key of ``salt``'s values (thread-safe)."""
        with self._lock:
            key = self._keys.get(salt)
            if key is not None:
                self._keys.move_to_end(salt)
                return key
        key = SealKey(self.key_id, AESGCM(_derive(self._root, _salt_info(salt))))
        with self._lock:
            self._keys[salt] = key
            if len(self._keys) > MAX_CACHED_KEYS:
                self._keys.popitem(last=False)
        return key


class TierKeys:
    """A process's sealing keys: the current secret's, and a previous one's for reading.

    During a rotation window the previous secret's values still open (the engine looks
    them up under the previous salts); everything new is sealed with the current secret.
    """

    def __init__(self, secret: bytes, previous: bytes | None = None) -> None:
        self.current = SecretKeys(secret)
        self.previous = None if previous is None else SecretKeys(previous)

    @classmethod
    def ephemeral(cls) -> TierKeys:
        """Keys that die with the process (no tenant secret: nothing is shared anyway)."""
        return cls(os.urandom(KEY_BYTES))


def new_nonce() -> bytes:
    """A fresh random nonce for one sealed value."""
    return os.urandom(NONCE_BYTES)
