"""Self-describing sealed values: a struct-packed header in the clear, then the sealed KV.

Layout (little-endian), format version 2::

    4s   magic b"PCKV"          u16 version         u16 header_len (multiple of 16)
    32s  block digest           32s namespace digest
    u32  depth (block index in its chain)           u64 payload length (plaintext)
    u8   dtype length           u8 layout length    u8 ndim
    8s   key id of the secret that sealed it        12s nonce
    ...  dtype, layout (ASCII), ndim x u32 shape, zero padding
    ...  payload, AES-256-GCM encrypted, then its 16-byte tag

The whole header is the AEAD's associated data (``seal``): a value whose payload, digest,
namespace, layout or key id was changed, or that was copied under another digest's key,
fails to open. A value loads only if every field also equals what this engine would
compute for that digest. Version 1 values (plain K/V with a CRC-32) are refused as
unsealed. Nothing is pickled: headers are parsed with ``struct`` only.
"""

from __future__ import annotations

import struct
from functools import lru_cache
from typing import NamedTuple

from cryptography.exceptions import InvalidTag

from prefixcache.tier.base import DIGEST_BYTES, BlockFormat, TierValueError
from prefixcache.tier.seal import KEY_ID_BYTES, NONCE_BYTES, TAG_BYTES, SealKey, new_nonce

MAGIC = b"PCKV"
VERSION = 2
UNSEALED_VERSION = 1  # plain values written before sealing: refused, removed
PREFIX = struct.Struct("<4sHH")  # magic, version, header_len
FIELDS = struct.Struct(f"<32s32sIQBBB{KEY_ID_BYTES}s{NONCE_BYTES}s")
ALIGN = 16
MIN_HEADER = PREFIX.size + FIELDS.size
MAX_HEADER = -(-(MIN_HEADER + 255 + 255 + 255 * 4) // ALIGN) * ALIGN


class ValueHeader(NamedTuple):
    """The parsed header of one stored value (strings still as bytes)."""

    digest: bytes
    namespace_digest: bytes
    depth: int
    payload_len: int
    dtype: bytes
    layout: bytes
    shape: tuple[int, ...]
    header_len: int
    key_id: bytes
    nonce: bytes

    @property
    def stored_len(self) -> int:
        """The whole value's length: header, sealed payload and tag."""
        return self.header_len + self.payload_len + TAG_BYTES


def _header_len(dtype_len: int, layout_len: int, ndim: int) -> int:
    unpadded = MIN_HEADER + dtype_len + layout_len + 4 * ndim
    return -(-unpadded // ALIGN) * ALIGN


@lru_cache(maxsize=64)
def _format_fields(fmt: BlockFormat) -> tuple[bytes, bytes, bytes]:
    """(dtype, layout, packed shape) of ``fmt``; ValueError if it cannot be encoded."""
    if len(fmt.namespace_digest) != DIGEST_BYTES:
        raise ValueError(f"namespace_digest must be {DIGEST_BYTES} bytes")
    dtype, layout = fmt.dtype.encode("ascii"), fmt.layout.encode("ascii")
    if len(dtype) > 255 or len(layout) > 255 or len(fmt.shape) > 255:
        raise ValueError("dtype, layout and shape are limited to 255 entries each")
    if fmt.itemsize <= 0 or any(d < 0 for d in fmt.shape):
        raise ValueError(f"bad itemsize or shape in {fmt}")
    return dtype, layout, struct.pack(f"<{len(fmt.shape)}I", *fmt.shape)


def check_format(fmt: BlockFormat) -> None:
    """Raise ValueError now if ``fmt`` cannot be encoded, rather than on the writer thread."""
    _format_fields(fmt)


def encode_value(
    fmt: BlockFormat, digest: bytes, depth: int, payload: bytes | memoryview, key: SealKey
) -> bytearray:
    """The stored value of one block: its header, then the payload sealed under ``key``."""
    view = memoryview(payload)
    if not view.c_contiguous:
        raise ValueError("payload must be C-contiguous")
    if view.nbytes != fmt.payload_bytes:
        raise ValueError(f"payload is {view.nbytes} bytes, format says {fmt.payload_bytes}")
    if len(digest) != DIGEST_BYTES:
        raise ValueError(f"digest must be {DIGEST_BYTES} bytes")
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    dtype, layout, shape = _format_fields(fmt)
    header_len = _header_len(len(dtype), len(layout), len(fmt.shape))
    lengths = (len(dtype), len(layout), len(fmt.shape))
    nonce = new_nonce()
    head = b"".join(
        (
            PREFIX.pack(MAGIC, VERSION, header_len),
            FIELDS.pack(digest, fmt.namespace_digest, depth, view.nbytes, *lengths, key.key_id,
                        nonce),
            dtype,
            layout,
            shape,
        )
    ).ljust(header_len, b"\x00")  # fmt: skip
    value = bytearray(header_len + view.nbytes + TAG_BYTES)  # one allocation, sealed in place
    value[:header_len] = head
    key.aead.encrypt_into(nonce, view, head, memoryview(value)[header_len:])
    return value


def read_header(value: bytes | memoryview) -> ValueHeader:
    """Parse a value's header (the payload may be absent); TierValueError if it cannot."""
    if len(value) < PREFIX.size:
        raise TierValueError("truncated" if MAGIC.startswith(bytes(value[:4])) else "magic")
    magic, version, header_len = PREFIX.unpack_from(value)
    if magic != MAGIC:
        raise TierValueError("magic")
    if version == UNSEALED_VERSION:
        raise TierValueError("unsealed", "a plain value from before values were sealed")
    if version != VERSION:
        raise TierValueError("version", f"format {version}, this engine reads {VERSION}")
    if len(value) < max(header_len, MIN_HEADER):
        raise TierValueError("truncated", f"{len(value)} bytes, header needs {header_len}")
    fields = FIELDS.unpack_from(value, PREFIX.size)
    digest, namespace, depth, payload_len, n_dtype, n_layout, ndim, key_id, nonce = fields
    if header_len != _header_len(n_dtype, n_layout, ndim):
        raise TierValueError("length", f"header_len {header_len} disagrees with its fields")
    start = PREFIX.size + FIELDS.size
    view = memoryview(value)
    dtype = bytes(view[start : start + n_dtype])
    layout = bytes(view[start + n_dtype : start + n_dtype + n_layout])
    shape = struct.unpack_from(f"<{ndim}I", value, start + n_dtype + n_layout)
    return ValueHeader(
        digest, namespace, depth, payload_len, dtype, layout, shape, header_len, key_id, nonce
    )


def _check_fields(fmt: BlockFormat, digest: bytes, header: ValueHeader) -> None:
    """Reject a header that names another block, model or tensor format."""
    dtype, layout, _ = _format_fields(fmt)
    if header.digest != digest:
        raise TierValueError("digest", f"stored {header.digest.hex()[:12]}")
    if header.namespace_digest != fmt.namespace_digest:
        raise TierValueError("namespace", f"stored {header.namespace_digest.hex()[:12]}")
    if header.dtype != dtype:
        raise TierValueError("dtype", f"stored {header.dtype!r}")
    if header.layout != layout:
        raise TierValueError("layout", f"stored {header.layout!r}")
    if header.shape != tuple(fmt.shape):
        raise TierValueError("shape", f"stored {header.shape}")
    if header.payload_len != fmt.payload_bytes:
        raise TierValueError("length", f"stored payload of {header.payload_len} bytes")


def decode_value(
    fmt: BlockFormat, digest: bytes, value: bytes | memoryview, key: SealKey
) -> memoryview:
    """The opened payload of a stored value; TierValueError(reason) if unfit or not ours."""
    header = read_header(value)
    _check_fields(fmt, digest, header)
    if len(value) != header.stored_len:
        reason = "truncated" if len(value) < header.stored_len else "length"
        raise TierValueError(reason, f"{len(value)} bytes, header says {header.stored_len}")
    if header.key_id != key.key_id:
        raise TierValueError("key", "sealed under another tenant secret")
    view = memoryview(value)
    try:
        plain = key.aead.decrypt(header.nonce, view[header.header_len :], view[: header.header_len])
    except InvalidTag:
        raise TierValueError("forged", "does not open under this tenant's key") from None
    return memoryview(plain)
