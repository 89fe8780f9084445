"""Block identity: the portable digest layout, its stability, typed extras, bad ids."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

import pytest

from prefixcache import KVCacheManager, MultiModalItem, Namespace
from prefixcache.cache.hashing import (
    block_digest,
    encode_tokens,
    get_hash_function,
    namespace_digest,
    serialize_extras,
)


def field(tag: int, payload: bytes) -> bytes:
    return struct.pack("<BI", tag, len(payload)) + payload


def documented_root(namespace: Namespace) -> bytes:
    """The root digest, built byte by byte as the README documents it."""
    pairs = [
        ("model", namespace.model),
        ("revision", namespace.revision),
        ("dtype", namespace.dtype),
        ("block_size", str(namespace.block_size)),
    ]
    body = b"prefixcache/v1" + struct.pack("<I", len(pairs))
    body += b"".join(field(0, f"{name}={value}".encode()) for name, value in pairs)
    return hashlib.sha256(body).digest()


def test_portable_digest_follows_the_documented_layout(make_manager):
    namespace = Namespace(model="SmolLM2-135M", revision="r1", dtype="f32", block_size=4)
    m = make_manager(num_blocks=4, block_size=4, namespace=namespace)
    seq = m.admit("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], cache_salt="tenant")
    root = documented_root(namespace)
    salt = struct.pack("<I", 1) + field(1, b"tenant")
    first = hashlib.sha256(
        root + struct.pack("<I", 4) + struct.pack("<4I", 1, 2, 3, 4) + salt
    ).digest()
    second = hashlib.sha256(
        first + struct.pack("<I", 4) + struct.pack("<4I", 5, 6, 7, 8) + struct.pack("<I", 0)
    ).digest()
    assert seq.block_hashes == [first.hex(), second.hex()]
    m.commit(seq, 9)  # stored digests equal the ones computed before commit
    assert seq.block_hashes == [first.hex(), second.hex()]
    m.free(seq)


def test_digests_are_equal_across_processes(make_manager):
    code = (
        "from prefixcache import KVCacheManager\n"
        "m = KVCacheManager(8, 4)\n"
        "print(','.join(m.admit('a', list(range(20)), cache_salt='s').block_hashes))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    m = make_manager(num_blocks=8, block_size=4)
    seq = m.admit("a", list(range(20)), cache_salt="s")
    assert out.stdout.strip().split(",") == seq.block_hashes
    m.free(seq)


def test_every_namespace_field_changes_the_root():
    sha = get_hash_function("sha256")
    base = Namespace(model="m", revision="r", dtype="f32", block_size=16)
    variants = [
        Namespace(model="m2", revision="r", dtype="f32", block_size=16),
        Namespace(model="m", revision="r2", dtype="f32", block_size=16),
        Namespace(model="m", revision="r", dtype="bf16", block_size=16),
        Namespace(model="m", revision="r", dtype="f32", block_size=32),
        Namespace(model="m", revision="r", dtype="f32", block_size=16, extra=(("rope", "2"),)),
    ]
    roots = {namespace_digest(n, sha) for n in [base, *variants]}
    assert len(roots) == 6


def test_extras_are_typed_and_length_prefixed():
    assert serialize_extras(((1, "x"),)) != serialize_extras(((2, "x"),))
    one = ((3, "ab", 0, 1), (3, "c", 1, 1))
    other = ((3, "a", 0, 1), (3, "bc", 1, 1))
    assert serialize_extras(one) != serialize_extras(other)
    sha = get_hash_function("sha256")
    tokens = encode_tokens([1, 2])
    assert block_digest(b"p", tokens, ((1, "x"),), sha) != block_digest(
        b"p", tokens, ((2, "x"),), sha
    )


def test_xxh3_option_gives_16_byte_digests_and_differs_from_sha256(make_manager):
    fast = make_manager(num_blocks=4, block_size=4, hash_algo="xxh3_128")
    slow = make_manager(num_blocks=4, block_size=4)
    a, b = fast.admit("a", list(range(9))), slow.admit("a", list(range(9)))
    assert [len(h) for h in a.block_hashes] == [32, 32]  # 16 bytes, hex
    assert [len(h) for h in b.block_hashes] == [64, 64]
    fast.free(a)
    slow.free(b)


def test_unknown_hash_algo_names_the_choices():
    with pytest.raises(ValueError, match=r"unknown hash_algo 'md5'.*sha256.*xxh3_128"):
        KVCacheManager(4, 4, hash_algo="md5")


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([1, -1], r"token_ids\[1\] = -1 is outside \[0, 4294967295\]"),
        ([2**32], r"token_ids\[0\] = 4294967296 is outside"),
        ([1, "a"], r"token_ids\[1\] is str, expected int"),
        ([1.5], r"token_ids\[0\] is float, expected int"),
    ],
)
def test_bad_token_ids_are_named(tokens, message):
    with pytest.raises(ValueError, match=message):
        encode_tokens(tokens)


def test_multimodal_items_change_only_the_blocks_they_touch(make_manager):
    m = make_manager(num_blocks=8, block_size=4)
    image = MultiModalItem("img-a", offset=5, length=2)
    seq = m.admit("a", list(range(13)), mm_items=[image])
    plain = m.admit("b", list(range(13)))
    assert seq.block_hashes[0] == plain.block_hashes[0]
    assert seq.block_hashes[1] != plain.block_hashes[1]
    assert seq.block_hashes[2] != plain.block_hashes[2]  # the chain carries it on
    m.free(seq)
    m.free(plain)
