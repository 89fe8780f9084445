"""Block identity: the exact in-process key and the portable digest chain.

In process a block is identified by ``(parent_uid, token_bytes[, extras])``: the parent's
content id (an integer never reused) and the block's own token ids as little-endian
uint32 bytes. Dict equality compares the bytes themselves, so two different blocks can
never share a key. The portable digest (SHA-256 by default) is computed once per stored
block, for keys that leave the process; its byte layout is documented in the README.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from prefixcache.cache.common import DEFAULT_BLOCK_SIZE, TOKEN_BYTES

ROOT_UID = 0
MAX_TOKEN_ID = 2**32 - 1
FORMAT_TAG = b"prefixcache/v1"

TAG_NAMESPACE_FIELD = 0
TAG_CACHE_SALT = 1
TAG_LORA_NAME = 2
TAG_MM_ITEM = 3
GROUP_TAG = b"kv-group"  # a window group's page of a block: its own identity (``group_digest``)

Extras = tuple[tuple, ...]


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything outside the prompt that changes KV values: the root of every chain."""

    model: str = "default"
    revision: str = ""
    dtype: str = ""
    block_size: int = DEFAULT_BLOCK_SIZE
    extra: tuple[tuple[str, str], ...] = ()

    def fields(self) -> list[tuple[str, str]]:
        """The namespace as ordered (name, value) string pairs."""
        base = [
            ("model", self.model),
            ("revision", self.revision),
            ("dtype", self.dtype),
            ("block_size", str(self.block_size)),
        ]
        return base + sorted(self.extra)


@dataclass(frozen=True, slots=True)
class MultiModalItem:
    """A non-text input occupying prompt positions [offset, offset + length)."""

    identifier: str
    offset: int
    length: int


def encode_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes; ValueError names a bad id."""
    try:
        return struct.pack(f"<{len(token_ids)}I", *token_ids)
    except struct.error:
        for position, token in enumerate(token_ids):
            if not isinstance(token, int) or isinstance(token, bool):
                raise ValueError(
                    f"token_ids[{position}] is {type(token).__name__}, expected int"
                ) from None
            if not 0 <= token <= MAX_TOKEN_ID:
                raise ValueError(
                    f"token_ids[{position}] = {token} is outside [0, {MAX_TOKEN_ID}]"
                ) from None
        raise


def block_extras(
    block_index: int,
    block_size: int,
    cache_salt: str | None,
    lora_name: str | None,
    mm_items: Sequence[MultiModalItem],
) -> Extras:
    """Typed extra keys of one block: salt and LoRA in block 0, media where they overlap."""
    extras: list[tuple] = []
    if block_index == 0:
        if cache_salt is not None:
            extras.append((TAG_CACHE_SALT, cache_salt))
        if lora_name is not None:
            extras.append((TAG_LORA_NAME, lora_name))
    start, end = block_index * block_size, (block_index + 1) * block_size
    for item in mm_items:
        if item.offset < end and item.offset + item.length > start:
            extras.append((TAG_MM_ITEM, item.identifier, item.offset, item.length))
    return tuple(extras)


def _field(tag: int, payload: bytes) -> bytes:
    """One typed, length-prefixed field: u8 tag, u32le length, payload."""
    return struct.pack("<BI", tag, len(payload)) + payload


def serialize_extras(extras: Extras) -> bytes:
    """Canonical bytes of a block's extras: u32le count, then one typed field each."""
    out = [struct.pack("<I", len(extras))]
    for extra in extras:
        tag = extra[0]
        if tag == TAG_MM_ITEM:
            _, identifier, offset, length = extra
            payload = struct.pack("<II", offset, length) + identifier.encode("utf-8")
        else:
            payload = extra[1].encode("utf-8")
        out.append(_field(tag, payload))
    return b"".join(out)


def _xxh3_128(data: bytes) -> bytes:
    import xxhash  # optional dependency: prefixcache[fast-hash]

    return xxhash.xxh3_128_digest(data)


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


HASH_FUNCTIONS: dict[str, Callable[[bytes], bytes]] = {
    "sha256": _sha256,
    "xxh3_128": _xxh3_128,
}


def get_hash_function(name: str) -> Callable[[bytes], bytes]:
    """The digest function for ``name``; ValueError lists the choices."""
    try:
        function = HASH_FUNCTIONS[name]
    except KeyError:
        raise ValueError(
            f"unknown hash_algo {name!r}; choose one of {sorted(HASH_FUNCTIONS)}"
        ) from None
    function(b"")  # fail now, not mid-request, if an optional module is missing
    return function


def namespace_digest(namespace: Namespace, hash_fn: Callable[[bytes], bytes]) -> bytes:
    """Root digest: FORMAT_TAG, then each namespace field as name=value, typed."""
    parts = [FORMAT_TAG, struct.pack("<I", len(namespace.fields()))]
    for name, value in namespace.fields():
        parts.append(_field(TAG_NAMESPACE_FIELD, f"{name}={value}".encode()))
    return hash_fn(b"".join(parts))


def block_digest(
    parent: bytes,
    token_bytes: bytes,
    extras: Extras,
    hash_fn: Callable[[bytes], bytes],
) -> bytes:
    """Chained digest: H(parent || u32le n_tokens || tokens || extras)."""
    header = struct.pack("<I", len(token_bytes) // TOKEN_BYTES)
    tail = serialize_extras(extras) if extras else b"\x00\x00\x00\x00"
    return hash_fn(parent + header + token_bytes + tail)


def chain_digests(
    parent: bytes, blocks: Iterable[tuple[bytes, Extras]], hash_fn: Callable[[bytes], bytes]
) -> list[bytes]:
    """The digests of consecutive full blocks, each chained from the one before ``parent``
    (the root, or the digest of the block before the first): ``blocks`` are (tokens, extras)."""
    digests = []
    for token_bytes, extras in blocks:
        parent = block_digest(parent, token_bytes, extras, hash_fn)
        digests.append(parent)
    return digests


def group_digest(digest: bytes, group: int, hash_fn: Callable[[bytes], bytes]) -> bytes:
    """The identity of a block's page in KV cache group ``group``: the block's digest for
    group 0 (the full layers), H(digest || GROUP_TAG || u16le group) for a window group."""
    if group == 0:
        return digest
    return hash_fn(digest + GROUP_TAG + struct.pack("<H", group))
