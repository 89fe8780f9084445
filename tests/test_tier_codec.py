"""The sealed-value codec: round trips, and every way a foreign, forged or damaged value is
refused; what the store holds looks random and opens only under its tenant's key."""

from __future__ import annotations

import hashlib
import os
import struct
from array import array

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixcache.tier import REJECT_REASONS, BlockFormat, TierValueError, decode_value
from prefixcache.tier.codec import FIELDS, MAX_HEADER, PREFIX, encode_value, read_header
from prefixcache.tier.seal import KEY_ID_BYTES, NONCE_BYTES, TAG_BYTES, TierKeys

NAMESPACE = hashlib.sha256(b"model-a").digest()
FMT = BlockFormat(NAMESPACE, "float32", "layer,kv,token,kv_head,head_dim", (2, 2, 4, 1, 8), 4)
DEFAULT_FMT = FMT._replace(shape=(30, 2, 16, 3, 64))
DIGEST = hashlib.sha256(b"block-0").digest()
KEYS = TierKeys(b"\x01" * 32)
KEY = KEYS.current.for_salt("tenant-a")


def payload(fmt: BlockFormat = FMT, seed: int = 0) -> bytes:
    return hashlib.shake_256(seed.to_bytes(8, "little")).digest(fmt.payload_bytes)


def rejection(fmt: BlockFormat, digest: bytes, value: bytes, key=KEY) -> str:
    with pytest.raises(TierValueError) as caught:
        decode_value(fmt, digest, value, key)
    return caught.value.reason


def test_payload_bytes_of_the_default_model():
    assert DEFAULT_FMT.payload_bytes == 720 * 1024


def test_round_trip_opens_the_sealed_payload():
    data = payload(DEFAULT_FMT)
    value = encode_value(DEFAULT_FMT, DIGEST, 7, data, KEY)
    out = decode_value(DEFAULT_FMT, DIGEST, value, KEY)
    assert isinstance(out, memoryview) and out == data
    header = read_header(value)
    assert header.depth == 7 and header.digest == DIGEST and header.header_len % 16 == 0
    assert header.key_id == KEY.key_id and len(header.nonce) == NONCE_BYTES
    assert len(value) == header.header_len + len(data) + TAG_BYTES == header.stored_len
    assert header.header_len <= MAX_HEADER
    assert data not in value  # the payload is not in the clear
    again = encode_value(DEFAULT_FMT, DIGEST, 7, data, KEY)
    assert again != value and read_header(again).nonce != header.nonce  # a nonce per value


def test_typed_memoryview_payload_is_encoded_as_its_bytes():
    floats = array("f", range(FMT.payload_bytes // 4))
    value = encode_value(FMT, DIGEST, 0, memoryview(floats), KEY)
    assert decode_value(FMT, DIGEST, value, KEY) == floats.tobytes()


def test_encode_refuses_wrong_sizes_and_strided_views():
    with pytest.raises(ValueError, match="payload is"):
        encode_value(FMT, DIGEST, 0, b"x" * 10, KEY)
    with pytest.raises(ValueError, match="contiguous"):
        encode_value(FMT, DIGEST, 0, memoryview(payload() * 2)[::2], KEY)
    with pytest.raises(ValueError, match="digest"):
        encode_value(FMT, DIGEST[:16], 0, payload(), KEY)


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
    value = encode_value(FMT, DIGEST, 0, payload(), KEY)
    assert rejection(other, DIGEST, value) == reason


def test_wrong_digest_is_rejected_and_a_rewritten_digest_fails_to_open():
    value = encode_value(FMT, DIGEST, 0, payload(), KEY)
    other = hashlib.sha256(b"other").digest()
    assert rejection(FMT, other, value) == "digest"
    moved = value[: PREFIX.size] + other + value[PREFIX.size + 32 :]  # header says "other"
    assert rejection(FMT, other, moved) == "forged"  # the digest is associated data


def test_truncation_at_several_points_is_rejected():
    value = encode_value(FMT, DIGEST, 0, payload(), KEY)
    header_len = read_header(value).header_len
    for cut in (0, 1, 3, 4, 7, PREFIX.size + 10, header_len - 1, header_len, len(value) - 1):
        assert rejection(FMT, DIGEST, value[:cut]) == "truncated", cut


def test_flipped_payload_or_tag_byte_is_a_forgery():
    for position in (-100, -1):  # in the ciphertext, in the tag
        value = bytearray(encode_value(FMT, DIGEST, 0, payload(), KEY))
        value[position] ^= 0x01
        assert rejection(FMT, DIGEST, bytes(value)) == "forged"


def test_header_fields_are_associated_data():
    value = bytearray(encode_value(FMT, DIGEST, 3, payload(), KEY))
    value[PREFIX.size + 64] ^= 0x01  # the depth field: nothing else would notice
    assert rejection(FMT, DIGEST, bytes(value)) == "forged"


def test_another_tenant_or_secret_opens_nothing():
    value = encode_value(FMT, DIGEST, 0, payload(), KEY)
    assert rejection(FMT, DIGEST, value, KEYS.current.for_salt("tenant-b")) == "forged"
    assert rejection(FMT, DIGEST, value, KEYS.current.for_salt(None)) == "forged"
    assert rejection(FMT, DIGEST, value, TierKeys(b"\x02" * 32).current.for_salt("tenant-a")) == (
        "key"
    )  # another secret's key id: not even tried
    key_id_at = PREFIX.size + FIELDS.size - KEY_ID_BYTES - NONCE_BYTES
    other = TierKeys(b"\x02" * 32).current.for_salt("tenant-a")
    relabelled = value[:key_id_at] + other.key_id + value[key_id_at + KEY_ID_BYTES :]
    assert rejection(FMT, DIGEST, relabelled, other) == "forged"


def test_an_unsealed_value_of_format_1_is_refused():
    value = encode_value(FMT, DIGEST, 0, payload(), KEY)
    plain = value[:4] + struct.pack("<H", 1) + value[6:]
    assert rejection(FMT, DIGEST, plain) == "unsealed"


def test_magic_version_and_length_rejections():
    value = encode_value(FMT, DIGEST, 0, payload(), KEY)
    assert rejection(FMT, DIGEST, b"GIF89a" + value[6:]) == "magic"
    assert rejection(FMT, DIGEST, b"\x80\x04\x95" + b"\x00" * 40) == "magic"  # a pickle
    future = value[:4] + struct.pack("<H", 3) + value[6:]
    assert rejection(FMT, DIGEST, future) == "version"
    assert rejection(FMT, DIGEST, value + b"\x00") == "length"
    header_len = read_header(value).header_len
    bad_len = value[:6] + struct.pack("<H", header_len + 16) + value[8:]
    assert rejection(FMT, DIGEST, bad_len) == "length"


def test_reasons_match_the_stats_vocabulary():
    assert set(REJECT_REASONS) == {
        "truncated", "magic", "version", "digest", "namespace",
        "dtype", "layout", "shape", "length", "unsealed", "key", "forged",
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
    value = encode_value(fmt, digest, depth, body, KEY)
    assert decode_value(fmt, digest, value, KEY) == body
    assert read_header(value).depth == depth


@given(fmt=formats, data=st.data())
def test_random_truncation_is_always_rejected(fmt: BlockFormat, data: st.DataObject):
    value = encode_value(fmt, DIGEST, 1, os.urandom(fmt.payload_bytes), KEY)
    cut = data.draw(st.integers(0, len(value) - 1))
    assert rejection(fmt, DIGEST, value[:cut]) == "truncated"


@given(fmt=formats, data=st.data())
def test_any_single_byte_change_is_rejected(fmt: BlockFormat, data: st.DataObject):
    value = bytearray(encode_value(fmt, DIGEST, 1, os.urandom(fmt.payload_bytes), KEY))
    position = data.draw(st.integers(0, len(value) - 1))
    value[position] ^= data.draw(st.integers(1, 255))
    assert rejection(fmt, DIGEST, bytes(value)) in REJECT_REASONS


def test_stored_kv_looks_random_not_like_floats():
    """Plausible K/V (small floats) sealed: the stored payload bytes decode as noise."""
    floats = array("f", [((i % 97) - 48) / 64 for i in range(DEFAULT_FMT.payload_bytes // 4)])
    value = encode_value(DEFAULT_FMT, DIGEST, 0, memoryview(floats), KEY)
    sealed = value[read_header(value).header_len : -TAG_BYTES]
    as_floats = array("f", sealed)
    plausible = sum(1 for x in as_floats if abs(x) < 16.0) / len(as_floats)
    assert plausible < 0.6  # random bits: about half of float32 values are tiny or huge
    counts = [0] * 256
    for byte in sealed:
        counts[byte] += 1
    expected = len(sealed) / 256
    chi2 = sum((c - expected) ** 2 / expected for c in counts)
    assert chi2 < 400  # 255 degrees of freedom: uniform bytes; the plain floats are far off
