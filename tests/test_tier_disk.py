"""DiskTier on a real directory: atomic files, restart, damage, cap and threads."""

from __future__ import annotations

import functools
import hashlib
import threading
from pathlib import Path

import pytest

from prefixcache.tier import BlockFormat, DiskTier, TierClient, TierError, decode_value
from prefixcache.tier.codec import encode_value, read_header
from prefixcache.tier.seal import TierKeys

FMT = BlockFormat(hashlib.sha256(b"ns").digest(), "float32", "layer,kv", (4, 32), 4)
KEY = TierKeys(bytes(32)).current.for_salt(None)  # one tenant secret's key for these tests


def digest(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def value(name: str, depth: int = 0) -> bytes:
    return _sealed(name, depth)


@functools.cache  # a sealed value has a random nonce: the same block gives the same bytes
def _sealed(name: str, depth: int) -> bytes:
    body = hashlib.shake_256(name.encode()).digest(FMT.payload_bytes)
    return encode_value(FMT, digest(name), depth, body, KEY)


SIZE = len(value("x"))


def block_file(root: Path, name: str) -> Path:
    hexed = digest(name).hex()
    return root / hexed[:2] / f"{hexed}.kvb"


def test_put_get_present(tmp_path: Path):
    tier = DiskTier(tmp_path, 1 << 20)
    names = ["a", "b", "c"]
    for depth, name in enumerate(names):
        assert tier.put(digest(name), value(name, depth), depth)
    assert not tier.put(digest("a"), value("a"), 0)  # already present
    assert tier.present([digest(n) for n in names]) == 3
    assert tier.present([digest("a"), digest("zz"), digest("b")]) == 1
    assert tier.get([digest("b"), digest("zz")]) == [value("b", 1), None]
    assert block_file(tmp_path, "a").exists() and len(tier) == 3
    assert tier.used_bytes == 3 * SIZE
    assert list((tmp_path / "tmp").iterdir()) == []
    tier.close()


def test_restart_sees_the_blocks(tmp_path: Path):
    tier = DiskTier(tmp_path, 1 << 20)
    tier.put(digest("a"), value("a", 0), 0)
    tier.put(digest("b"), value("b", 5), 5)
    tier.close()
    again = DiskTier(tmp_path, 1 << 20)
    assert again.present([digest("a"), digest("b")]) == 2
    assert again.get([digest("b")]) == [value("b", 5)]
    assert again.used_bytes == 2 * SIZE
    assert again._entries[digest("b")].depth == 5
    again.close()


def test_second_owner_of_a_path_is_refused(tmp_path: Path):
    tier = DiskTier(tmp_path, 1 << 20)
    with pytest.raises(TierError, match="in use"):
        DiskTier(tmp_path, 1 << 20)
    tier.close()
    DiskTier(tmp_path, 1 << 20).close()


def test_start_up_deletes_torn_files_and_temp_files(tmp_path: Path):
    tier = DiskTier(tmp_path, 1 << 20)
    for name in ("good", "torn", "junk", "renamed"):
        tier.put(digest(name), value(name), 0)
    tier.close()
    torn = block_file(tmp_path, "torn")
    torn.write_bytes(torn.read_bytes()[: SIZE // 2])
    block_file(tmp_path, "junk").write_bytes(b"not a block")
    block_file(tmp_path, "renamed").rename(
        block_file(tmp_path, "renamed").with_name("0" * 64 + ".kvb")
    )
    (tmp_path / "tmp" / "leftover.123.456").write_bytes(b"half a write")
    again = DiskTier(tmp_path, 1 << 20)
    assert len(again) == 1 and again.present([digest("good")]) == 1
    assert list((tmp_path / "tmp").iterdir()) == []
    assert not torn.exists() and not block_file(tmp_path, "junk").exists()
    assert sorted(p.name for p in tmp_path.glob("*/*.kvb")) == [block_file(tmp_path, "good").name]
    again.close()


def test_file_torn_after_start_is_a_rejected_miss_and_is_replaced(tmp_path: Path):
    client = TierClient(DiskTier(tmp_path, 1 << 20), FMT)
    client.backend.put(digest("a"), value("a"), 0)
    path = block_file(tmp_path, "a")
    path.write_bytes(path.read_bytes()[:-10])
    assert client.fetch([digest("a")], KEY) == []
    stats = client.stats  # the tier refused the short file before decoding: a plain miss
    assert stats.rejected == {} and stats.miss_blocks == 1
    assert client.backend.rejected_files == {"wrong_size": 1}
    assert not path.exists()  # removed, so the block can be written again
    body = hashlib.shake_256(b"a").digest(FMT.payload_bytes)
    assert client.submit_write(digest("a"), 0, body, KEY) and client.flush(5)
    assert client.fetch([digest("a")], KEY) == [body]
    client.close()


def test_cap_evicts_deepest_first_then_least_recently_used(tmp_path: Path):
    removed: list[bytes] = []
    tier = DiskTier(tmp_path, 4 * SIZE, on_removed=removed.extend)
    for name, depth in [("root", 0), ("mid", 1), ("leaf", 2), ("mid2", 1)]:
        assert tier.put(digest(name), value(name, depth), depth)
    assert tier.put(digest("other-root"), value("other-root"), 0)
    assert removed == [digest("leaf")]  # the deepest went first
    tier.get([digest("mid")])  # now mid2 is the older of the two at depth 1
    tier.put(digest("third-root"), value("third-root"), 0)
    assert removed == [digest("leaf"), digest("mid2")]
    assert tier.evictions == 2 and tier.used_bytes == 4 * SIZE
    assert not block_file(tmp_path, "leaf").exists()
    assert tier.present([digest("root"), digest("mid")]) == 2
    tier.close()


def test_a_smaller_cap_at_restart_evicts(tmp_path: Path):
    tier = DiskTier(tmp_path, 10 * SIZE)
    for depth in range(4):
        tier.put(digest(f"b{depth}"), value(f"b{depth}", depth), depth)
    tier.close()
    removed: list[bytes] = []
    again = DiskTier(tmp_path, 2 * SIZE, on_removed=removed.extend)
    assert removed == [digest("b3"), digest("b2")] and len(again) == 2
    again.close()


def test_oversized_value_is_not_written(tmp_path: Path):
    tier = DiskTier(tmp_path, SIZE - 1)
    assert not tier.put(digest("a"), value("a"), 0)
    assert len(tier) == 0
    tier.close()


def test_on_stored_and_discard_callbacks(tmp_path: Path):
    stored: list[bytes] = []
    removed: list[bytes] = []
    tier = DiskTier(tmp_path, 1 << 20, on_stored=stored.append, on_removed=removed.extend)
    tier.put(digest("a"), value("a"), 0)
    tier.discard([digest("a"), digest("never")])
    assert stored == [digest("a")] and removed == [digest("a")]
    assert tier.present([digest("a")]) == 0 and tier.used_bytes == 0
    tier.close()


def test_concurrent_writer_and_reader_never_see_a_bad_block(tmp_path: Path):
    tier = DiskTier(tmp_path, 20 * SIZE)  # small: the writer keeps evicting
    names = [f"n{i}" for i in range(100)]
    done = threading.Event()
    problems: list[str] = []

    loaded = [0]

    def read_loop() -> None:
        while not done.is_set():
            for name, stored in zip(names, tier.get([digest(n) for n in names]), strict=True):
                if stored is None:
                    continue
                try:
                    body = decode_value(FMT, digest(name), stored, KEY)
                    assert body == hashlib.shake_256(name.encode()).digest(FMT.payload_bytes)
                    loaded[0] += 1
                except Exception as error:  # a thread's exception would not fail the test
                    problems.append(f"{name}: {error!r}")

    reader = threading.Thread(target=read_loop)
    reader.start()
    try:
        for i, name in enumerate(names):
            tier.put(digest(name), value(name, i % 7), i % 7)
    finally:
        done.set()
        reader.join()
    assert problems == [] and loaded[0] > 0
    assert len(tier) <= 20 and tier.used_bytes <= 20 * SIZE
    on_disk = sorted(tmp_path.glob("*/*.kvb"))
    assert len(on_disk) == len(tier)
    for path in on_disk:
        assert read_header(path.read_bytes()).digest.hex() == path.stem
    tier.close()
