"""Self-describing stored values: a struct-packed header, then the block's KV bytes.

Layout (little-endian), format version 1::

    4s   magic b"PCKV"          u16 version         u16 header_len (multiple of 16)
    32s  block digest           32s namespace digest
    u32  depth (block index in its chain)           u64 payload length
    u8   dtype length           u8 layout length    u8 ndim
    ...  dtype, layout (ASCII), ndim x u32 shape, zero padding
    u32  CRC-32 of the header before it, then of the payload
    ...  payload (starts 16-byte aligned when the value's buffer is)

A value loads only if every field equals what this engine would compute for that digest.
CRC-32 (zlib) costs about 0.22 ms on a 720 KiB payload here (SHA-256: 0.67 ms, BLAKE2b:
1.3 ms); it catches torn writes and bit rot, not forgery — guard a shared store with auth.
Nothing is pickled: values are parsed with ``struct`` only.
"""

from __future__ import annotations

import struct
import zlib
from functools import lru_cache
from typing import NamedTuple

from prefixcache.tier.base import DIGEST_BYTES, BlockFormat, TierValueError

MAGIC = b"PCKV"
VERSION = 1
PREFIX = struct.Struct("<4sHH")  # magic, version, header_len
FIELDS = struct.Struct("<32s32sIQBBB")  # digest, namespace, depth, payload_len, 3 lengths
CHECKSUM = struct.Struct("<I")
ALIGN = 16
MIN_HEADER = PREFIX.size + FIELDS.size + CHECKSUM.size
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
    checksum: int


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


def encode_value(fmt: BlockFormat, digest: bytes, depth: int, payload: bytes | memoryview) -> bytes:
    """The stored value of one block: header then payload, in one allocation."""
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
    head = b"".join(
        (
            PREFIX.pack(MAGIC, VERSION, header_len),
            FIELDS.pack(digest, fmt.namespace_digest, depth, view.nbytes, *lengths),
            dtype,
            layout,
            shape,
        )
    )
    head = head.ljust(header_len - CHECKSUM.size, b"\x00")
    checksum = zlib.crc32(view, zlib.crc32(head))
    return b"".join((head, CHECKSUM.pack(checksum), view))


def read_header(value: bytes | memoryview) -> ValueHeader:
    """Parse a value's header (the payload may be absent); TierValueError if it cannot."""
    if len(value) < PREFIX.size:
        raise TierValueError("truncated" if MAGIC.startswith(bytes(value[:4])) else "magic")
    magic, version, header_len = PREFIX.unpack_from(value)
    if magic != MAGIC:
        raise TierValueError("magic")
    if version != VERSION:
        raise TierValueError("version", f"format {version}, this engine reads {VERSION}")
    if len(value) < max(header_len, MIN_HEADER):
        raise TierValueError("truncated", f"{len(value)} bytes, header needs {header_len}")
    digest, namespace, depth, payload_len, n_dtype, n_layout, ndim = FIELDS.unpack_from(
        value, PREFIX.size
    )
    if header_len != _header_len(n_dtype, n_layout, ndim):
        raise TierValueError("length", f"header_len {header_len} disagrees with its fields")
    start = PREFIX.size + FIELDS.size
    view = memoryview(value)
    dtype = bytes(view[start : start + n_dtype])
    layout = bytes(view[start + n_dtype : start + n_dtype + n_layout])
    shape = struct.unpack_from(f"<{ndim}I", value, start + n_dtype + n_layout)
    (checksum,) = CHECKSUM.unpack_from(value, header_len - CHECKSUM.size)
    return ValueHeader(
        digest, namespace, depth, payload_len, dtype, layout, shape, header_len, checksum
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


def decode_value(fmt: BlockFormat, digest: bytes, value: bytes | memoryview) -> memoryview:
    """The payload of a stored value, as a zero-copy view; TierValueError(reason) if unfit."""
    header = read_header(value)
    _check_fields(fmt, digest, header)
    size = len(value) - header.header_len
    if size != header.payload_len:
        reason = "truncated" if size < header.payload_len else "length"
        raise TierValueError(reason, f"{size} payload bytes, header says {header.payload_len}")
    view = memoryview(value)
    payload = view[header.header_len :]
    checksum = zlib.crc32(payload, zlib.crc32(view[: header.header_len - CHECKSUM.size]))
    if checksum != header.checksum:
        raise TierValueError("checksum")
    return payload
