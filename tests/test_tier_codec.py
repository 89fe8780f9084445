"""The stored-value codec: round trips, and every way a foreign or damaged value is refused."""

from __future__ import annotations

import hashlib
import os
import struct
from array import array

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixcache.tier import REJECT_REASONS, BlockFormat, TierValueError, decode_value
from prefixcache.tier.codec import CHECKSUM, MAX_HEADER, PREFIX, encode_value, read_header

NAMESPACE = hashlib.sha256(b"model-a").digest()
FMT = BlockFormat(NAMESPACE, "float32", "layer,kv,token,kv_head,head_dim", (2, 2, 4, 1, 8), 4)
DEFAULT_FMT = FMT._replace(shape=(30, 2, 16, 3, 64))
DIGEST = hashlib.sha256(b"block-0").digest()


def payload(fmt: BlockFormat = FMT, seed: int = 0) -> bytes:
    return hashlib.shake_256(seed.to_bytes(8, "little")).digest(fmt.payload_bytes)


def rejection(fmt: BlockFormat, digest: bytes, value: bytes) -> str:
    with pytest.raises(TierValueError) as caught:
        decode_value(fmt, digest, value)
    return caught.value.reason


def test_payload_bytes_of_the_default_model():
    assert DEFAULT_FMT.payload_bytes == 720 * 1024


def test_round_trip_returns_a_view_into_the_value():
    data = payload(DEFAULT_FMT)
    value = encode_value(DEFAULT_FMT, DIGEST, 7, data)
    out = decode_value(DEFAULT_FMT, DIGEST, value)
    assert isinstance(out, memoryview) and out.obj is value  # no copy of the payload
    assert out == data
    header = read_header(value)
    assert header.depth == 7 and header.digest == DIGEST and header.header_len % 16 == 0
    assert len(value) == header.header_len + len(data) and header.header_len <= MAX_HEADER


def test_typed_memoryview_payload_is_encoded_as_its_bytes():
    floats = array("f", range(FMT.payload_bytes // 4))
    value = encode_value(FMT, DIGEST, 0, memoryview(floats))
    assert decode_value(FMT, DIGEST, value) == floats.tobytes()


def test_encode_refuses_wrong_sizes_and_strided_views():
    with pytest.raises(ValueError, match="payload is"):
        encode_value(FMT, DIGEST, 0, b"x" * 10)
    with pytest.raises(ValueError, match="contiguous"):
        encode_value(FMT, DIGEST, 0, memoryview(payload() * 2)[::2])
    with pytest.raises(ValueError, match="digest"):
        encode_value(FMT, DIGEST[:16], 0, payload())


@pytest.mark.parametrize(
    ("other", "reason"),
    [
        (FMT._replace(namespace_digest=hashlib.sha256(b"model-b").digest()), "namespace"),
        (FMT._replace(dtype="bfloat16", itemsize=2, shape=(2, 2, 4, 1, 16)), "dtype"),
        (FMT._replace(layout="layer,kv,kv_head,token,head_dim"), "layout"),
        (FMT._replace(shape=(2, 2, 4, 2, 4)), "shape"),
        (FMT._replace(shape=(2, 2, 4, 1, 16)), "shape"),
    ],
)
def test_a_value_from_another_engine_is_rejected(other: BlockFormat, reason: str):
    value = encode_value(FMT, DIGEST, 0, payload())
    assert rejection(other, DIGEST, value) == reason


def test_wrong_digest_is_rejected():
    value = encode_value(FMT, DIGEST, 0, payload())
    assert rejection(FMT, hashlib.sha256(b"other").digest(), value) == "digest"


def test_truncation_at_several_points_is_rejected():
    value = encode_value(FMT, DIGEST, 0, payload())
    header_len = read_header(value).header_len
    for cut in (0, 1, 3, 4, 7, PREFIX.size + 10, header_len - 1, header_len, len(value) - 1):
        assert rejection(FMT, DIGEST, value[:cut]) == "truncated", cut


def test_flipped_payload_byte_fails_the_checksum():
    value = bytearray(encode_value(FMT, DIGEST, 0, payload()))
    value[-100] ^= 0x01
    assert rejection(FMT, DIGEST, bytes(value)) == "checksum"


def test_header_fields_are_covered_by_the_checksum():
    value = bytearray(encode_value(FMT, DIGEST, 3, payload()))
    value[PREFIX.size + 64] ^= 0x01  # the depth field: nothing else would notice
    assert rejection(FMT, DIGEST, bytes(value)) == "checksum"


def test_magic_version_and_length_rejections():
    value = encode_value(FMT, DIGEST, 0, payload())
    assert rejection(FMT, DIGEST, b"GIF89a" + value[6:]) == "magic"
    assert rejection(FMT, DIGEST, b"\x80\x04\x95" + b"\x00" * 40) == "magic"  # a pickle
    future = value[:4] + struct.pack("<H", 2) + value[6:]
    assert rejection(FMT, DIGEST, future) == "version"
    assert rejection(FMT, DIGEST, value + b"\x00") == "length"
    header_len = read_header(value).header_len
    bad_len = value[:6] + struct.pack("<H", header_len + 16) + value[8:]
    assert rejection(FMT, DIGEST, bad_len) == "length"


def test_reasons_match_the_stats_vocabulary():
    assert set(REJECT_REASONS) == {
        "truncated", "magic", "version", "digest", "namespace",
        "dtype", "layout", "shape", "length", "checksum",
    }  # fmt: skip


formats = st.builds(
    lambda shape, itemsize, dtype, layout: BlockFormat(NAMESPACE, dtype, layout, shape, itemsize),
    st.lists(st.integers(1, 6), min_size=1, max_size=5).map(tuple),
    st.sampled_from([1, 2, 4, 8]),
    st.text("abcdefghijklmnopqrstuvwxyz0123456789", min_size=1, max_size=12),
    st.text("abcdefghijklmnopqrstuvwxyz,_", max_size=40),
)


@given(fmt=formats, depth=st.integers(0, 2**32 - 1), data=st.data())
def test_random_round_trips(fmt: BlockFormat, depth: int, data: st.DataObject):
    body = data.draw(st.binary(min_size=fmt.payload_bytes, max_size=fmt.payload_bytes))
    digest = data.draw(st.binary(min_size=32, max_size=32))
    value = encode_value(fmt, digest, depth, body)
    assert decode_value(fmt, digest, value) == body
    assert read_header(value).depth == depth


@given(fmt=formats, data=st.data())
def test_random_truncation_is_always_rejected(fmt: BlockFormat, data: st.DataObject):
    value = encode_value(fmt, DIGEST, 1, os.urandom(fmt.payload_bytes))
    cut = data.draw(st.integers(0, len(value) - 1))
    assert rejection(fmt, DIGEST, value[:cut]) == "truncated"


@given(fmt=formats, data=st.data())
def test_any_single_byte_change_is_rejected(fmt: BlockFormat, data: st.DataObject):
    value = bytearray(encode_value(fmt, DIGEST, 1, os.urandom(fmt.payload_bytes)))
    position = data.draw(st.integers(0, len(value) - 1))
    value[position] ^= data.draw(st.integers(1, 255))
    assert rejection(fmt, DIGEST, bytes(value)) in REJECT_REASONS


def test_checksum_field_sits_just_before_the_payload():
    value = encode_value(FMT, DIGEST, 0, payload())
    header = read_header(value)
    (stored,) = CHECKSUM.unpack_from(value, header.header_len - CHECKSUM.size)
    assert stored == header.checksum
