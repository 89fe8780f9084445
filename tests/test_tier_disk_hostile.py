"""DiskTier against a hostile folder: links, FIFOs, strangers' files, loose modes (issue 21).

Each case is built from real files under tmp_path; after each, the tier must still store
and serve a normal block. The suite runs as root, so ownership is checked by uid, not access.
"""

from __future__ import annotations

import math
import os
import stat
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefixcache.tier import DiskTier, TierError
from prefixcache.tier.safe_files import read_regular
from test_tier_disk import SIZE, block_file, digest, value

STRANGER = 12345


def still_works(tier: DiskTier) -> None:
    """A fresh block goes in and comes back out."""
    name = f"fresh-{len(tier)}-{time.monotonic_ns()}"
    assert tier.put(digest(name), value(name), 0)
    assert tier.get([digest(name)]) == [value(name)]


def stored(root: Path, *names: str) -> None:
    """Fill ``root`` with the named blocks and close the tier again."""
    tier = DiskTier(root, 1 << 20)
    for name in names:
        assert tier.put(digest(name), value(name), 0)
    tier.close()


def files_under(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A folder outside the tier with files that must survive whatever the tier does."""
    folder = tmp_path / "victim"
    (folder / "deep").mkdir(parents=True)
    (folder / "precious.txt").write_bytes(b"keep me")
    (folder / "deep" / "also.txt").write_bytes(b"and me")
    return folder


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "kv"


def test_tmp_symlinked_to_another_folder_deletes_nothing_there(root: Path, victim: Path):
    stored(root, "a")
    before = files_under(victim)
    (root / "tmp").rmdir()
    (root / "tmp").symlink_to(victim, target_is_directory=True)
    tier = DiskTier(root, 1 << 20)  # starts: the link was only a name in our own folder
    assert files_under(victim) == before
    assert (root / "tmp").is_dir() and not (root / "tmp").is_symlink()
    assert tier.rejected_files == {"symlink": 1}
    assert tier.get([digest("a")]) == [value("a")]
    still_works(tier)
    tier.close()


def test_tmp_cleanup_unlinks_names_only_and_never_recurses(root: Path, victim: Path):
    stored(root, "a")
    tmp = root / "tmp"
    (tmp / "leftover.1.2").write_bytes(b"half a write")
    (tmp / "to-a-folder").symlink_to(victim, target_is_directory=True)
    (tmp / "to-a-file").symlink_to(victim / "precious.txt")
    (tmp / "a-folder").mkdir()
    (tmp / "a-folder" / "inside").write_bytes(b"not ours to walk into")
    os.mkfifo(tmp / "a-fifo")
    before = files_under(victim)
    tier = DiskTier(root, 1 << 20)
    assert files_under(victim) == before
    assert sorted(p.name for p in tmp.iterdir()) == ["a-fifo", "a-folder"]
    assert (tmp / "a-folder" / "inside").exists()
    assert tier.rejected_files == {"symlink": 2, "not_regular": 2}  # the folder, the FIFO
    still_works(tier)
    tier.close()


def start_within(root: Path, seconds: float) -> tuple[DiskTier | None, float]:
    """Start a DiskTier on a thread; (the tier or None if it hung, the time it took)."""
    result: list[DiskTier] = []
    began = time.monotonic()
    thread = threading.Thread(target=lambda: result.append(DiskTier(root, 1 << 20)), daemon=True)
    thread.start()
    thread.join(seconds)
    return (result[0] if result else None), time.monotonic() - began


def test_a_fifo_in_place_of_a_block_does_not_hang_start_up(root: Path):
    stored(root, "a", "b")
    fifo = block_file(root, "a")
    fifo.unlink()
    os.mkfifo(fifo)
    tier, took = start_within(root, 5)
    if tier is None and os.path.lexists(fifo):  # a writer ends the hung open(): no leak
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert tier is not None, "start-up hung on a FIFO"
    assert took < 1.0
    assert tier.present([digest("a")]) == 0 and tier.present([digest("b")]) == 1
    assert tier.rejected_files == {"not_regular": 1} and not os.path.lexists(fifo)
    still_works(tier)
    assert tier.put(digest("a"), value("a"), 0) and tier.get([digest("a")]) == [value("a")]
    tier.close()


class ReadSpy:
    """Counts the bytes ``os.read`` returns while installed."""

    def __init__(self) -> None:
        self.real, self.total = os.read, 0

    def __call__(self, fd: int, n: int) -> bytes:
        data = self.real(fd, n)
        self.total += len(data)
        return data


def test_a_block_swapped_for_a_symlink_while_running_is_not_read(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    tier = DiskTier(root, 1 << 20)
    tier.put(digest("a"), value("a"), 0)
    tier.put(digest("b"), value("b"), 0)
    big = tmp_path / "big"
    with open(big, "wb") as handle:
        handle.truncate(50 << 20)  # sparse: 50 MB that cost nothing to make
    path = block_file(root, "a")
    path.unlink()
    path.symlink_to(big)
    spy = ReadSpy()
    monkeypatch.setattr(os, "read", spy)
    assert tier.get([digest("a")]) == [None]
    assert spy.total == 0  # O_NOFOLLOW refused the link: not one byte read through it
    monkeypatch.undo()
    assert tier.get([digest("b")]) == [value("b")]
    assert tier.present([digest("a")]) == 0 and not os.path.lexists(path)
    assert big.stat().st_size == 50 << 20 and tier.rejected_files == {"symlink": 1}
    still_works(tier)
    tier.close()


# In a child with 1 GiB of address space, so a regression fails instead of eating the machine.
DEV_ZERO_CHILD = """
import os, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
from prefixcache.tier import DiskTier
root, a, b = sys.argv[1], bytes.fromhex(sys.argv[2]), bytes.fromhex(sys.argv[3])
tier = DiskTier(root, 1 << 20)
path = os.path.join(root, a.hex()[:2], a.hex() + ".kvb")
os.unlink(path)
os.symlink("/dev/zero", path)
print(tier.get([a]) == [None], tier.get([b]) != [None], tier.rejected_files)
"""


def test_a_block_swapped_for_dev_zero_while_running_is_a_miss(root: Path):
    stored(root, "a", "b")
    args = [root, digest("a").hex(), digest("b").hex()]
    child = subprocess.run(
        [sys.executable, "-c", DEV_ZERO_CHILD, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split("\n")[0] == "True True {'symlink': 1}"
    tier = DiskTier(root, 1 << 20)
    assert tier.present([digest("a")]) == 0 and tier.get([digest("b")]) == [value("b")]
    still_works(tier)
    tier.close()


@pytest.mark.parametrize("change", [b"extra bytes", -10])
def test_a_block_of_the_wrong_size_is_a_removed_miss(root: Path, change: bytes | int):
    removed: list[bytes] = []
    tier = DiskTier(root, 1 << 20, on_removed=removed.extend)
    tier.put(digest("a"), value("a"), 0)
    path = block_file(root, "a")
    with open(path, "r+b") as handle:  # the same inode, grown or cut in place
        handle.seek(0, os.SEEK_END)
        handle.write(change) if isinstance(change, bytes) else handle.truncate(SIZE + change)
    assert tier.get([digest("a")]) == [None]
    assert not path.exists() and tier.used_bytes == 0 and removed == [digest("a")]
    assert tier.rejected_files == {"wrong_size": 1}
    assert tier.put(digest("a"), value("a"), 0) and tier.get([digest("a")]) == [value("a")]
    still_works(tier)
    tier.close()


def test_a_strangers_block_file_is_refused_at_scan_and_at_read(root: Path):
    stored(root, "a", "b", "c")
    os.chown(block_file(root, "a"), STRANGER, STRANGER)
    tier = DiskTier(root, 1 << 20)
    assert tier.present([digest("a")]) == 0 and tier.present([digest("b")]) == 1
    assert not block_file(root, "a").exists()
    os.chown(block_file(root, "b"), STRANGER, STRANGER)
    os.chmod(block_file(root, "c"), 0o666)  # ours, but anyone could have rewritten it
    assert tier.get([digest("b"), digest("c")]) == [None, None]
    assert tier.rejected_files == {"foreign_owner": 2, "writable_by_others": 1}
    still_works(tier)
    tier.close()


def test_a_folder_in_place_of_a_block_file_is_left_alone(root: Path):
    stored(root, "a")
    path = block_file(root, "a")
    path.unlink()
    path.mkdir()
    (path / "inside").write_bytes(b"x")
    tier = DiskTier(root, 1 << 20)
    assert len(tier) == 0 and (path / "inside").exists()  # never recursed into
    assert tier.rejected_files == {"not_regular": 1}
    still_works(tier)
    tier.close()


@pytest.mark.parametrize(
    ("mode", "wrong", "fix"),
    [
        (0o777, "writable by group and others (mode 0777)", "run `chmod 700 {root}`"),
        (0o720, "writable by group (mode 0720)", "run `chmod 700 {root}`"),
        (0o1777, "writable by group and others (mode 1777)", "use a folder of its own inside it"),
    ],
)
def test_a_folder_others_can_write_is_refused(root: Path, mode: int, wrong: str, fix: str):
    stored(root, "a")
    root.chmod(mode)
    with pytest.raises(TierError) as caught:
        DiskTier(root, 1 << 20)
    assert str(caught.value).startswith(f"disk tier {root}: {wrong}; {fix.format(root=root)}")
    root.chmod(0o700)  # the fix the message gives
    tier = DiskTier(root, 1 << 20)
    assert tier.get([digest("a")]) == [value("a")]
    still_works(tier)
    tier.close()


def test_a_shared_sticky_folder_of_another_user_is_never_chowned(tmp_path: Path):
    shared = tmp_path / "shared"  # like /tmp for a user who is not its owner
    shared.mkdir()
    shared.chmod(0o1777)
    os.chown(shared, 12345, 12345)
    with pytest.raises(TierError) as caught:
        DiskTier(shared, 1 << 20)
    message = str(caught.value)
    assert "owned by uid 12345" in message and "use a folder of its own inside it" in message
    assert "chown" not in message and "chmod" not in message


def test_a_symlink_as_the_folder_is_refused(root: Path, tmp_path: Path):
    real = tmp_path / "real"
    stored(real, "a")
    root.symlink_to(real, target_is_directory=True)
    with pytest.raises(TierError, match=f"disk tier {root}: a symbolic link to {real}; use `disk:"):
        DiskTier(root, 1 << 20)
    tier = DiskTier(real, 1 << 20)
    still_works(tier)
    tier.close()


def test_a_strangers_folder_is_refused(root: Path):
    stored(root, "a")
    os.chown(root, STRANGER, STRANGER)
    with pytest.raises(TierError, match=f"owned by uid {STRANGER}.*run `chown -R 0 {root}`"):
        DiskTier(root, 1 << 20)
    os.chown(root, 0, 0)
    DiskTier(root, 1 << 20).close()


def test_a_symlinked_subfolder_is_not_followed(root: Path, tmp_path: Path):
    stored(root, "a")
    shard = block_file(root, "a").parent
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shard.rename(elsewhere / shard.name)
    shard.symlink_to(elsewhere / shard.name, target_is_directory=True)
    before = files_under(elsewhere)
    tier = DiskTier(root, 1 << 20)
    assert len(tier) == 0 and tier.rejected_files == {"symlink": 1}
    assert not os.path.lexists(shard) and files_under(elsewhere) == before
    assert tier.put(digest("a"), value("a"), 0)  # into a new, real subfolder
    assert shard.is_dir() and not shard.is_symlink() and files_under(elsewhere) == before
    assert tier.get([digest("a")]) == [value("a")]
    tier.close()


@pytest.mark.parametrize("hostile", ["loose", "stranger"])
def test_a_subfolder_others_can_write_refuses_start(root: Path, hostile: str):
    stored(root, "a", "b")
    shard = block_file(root, "a").parent
    shard.chmod(0o777) if hostile == "loose" else os.chown(shard, STRANGER, STRANGER)
    fix = f"chmod -R go-w {root}" if hostile == "loose" else f"chown -R 0 {root}"
    with pytest.raises(TierError, match=f"disk tier {shard}: .*; run `{fix}`"):
        DiskTier(root, 1 << 20)
    shard.chmod(0o700) if hostile == "loose" else os.chown(shard, 0, 0)
    tier = DiskTier(root, 1 << 20)
    assert tier.present([digest("a"), digest("b")]) == 2
    still_works(tier)
    tier.close()


def test_a_symlinked_lock_file_is_refused_and_its_target_not_made(root: Path, tmp_path: Path):
    stored(root, "a")
    (root / "lock").unlink()
    (root / "lock").symlink_to(tmp_path / "made-by-us")
    with pytest.raises(TierError, match=f"disk tier {root / 'lock'}: a symbolic link; remove it"):
        DiskTier(root, 1 << 20)
    assert not (tmp_path / "made-by-us").exists()
    (root / "lock").unlink()
    tier = DiskTier(root, 1 << 20)
    still_works(tier)
    tier.close()


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_new_folders_and_files_are_owner_only_even_under_umask_0(tmp_path: Path):
    old = os.umask(0)
    try:
        root = tmp_path / "new" / "kv"
        tier = DiskTier(root, 1 << 20)
        tier.put(digest("a"), value("a"), 0)
    finally:
        os.umask(old)
    for folder in (root.parent, root, root / "tmp", block_file(root, "a").parent):
        assert mode(folder) == 0o700, folder
    assert mode(root / "lock") == 0o600 and mode(block_file(root, "a")) == 0o600
    tier.close()


def test_an_old_lock_file_is_made_owner_only(root: Path):
    stored(root, "a")
    (root / "lock").chmod(0o666)
    DiskTier(root, 1 << 20).close()
    assert mode(root / "lock") == 0o600


def test_bounded_read_never_reads_more_than_asked(tmp_path: Path):
    with open(tmp_path / "big", "wb") as handle:
        handle.truncate(50 << 20)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        data, info = read_regular(fd, "big", 4097)
        assert len(data) == 4097 and info.st_size == 50 << 20
    finally:
        os.close(fd)


# -- retention records (``<digest>.ret`` beside a retained block) ---------------------------


def _record(root: Path, name: str) -> Path:
    return block_file(root, name).with_suffix(".ret")


def _retained(root: Path, name: str) -> None:
    """Store block ``name`` retained for a day, and close the tier again."""
    tier = DiskTier(root, 1 << 20)
    assert tier.put(digest(name), value(name), 0, 86400.0)
    tier.close()
    assert _record(root, name).is_file()


def _spoil(path: Path, how: str, victim: Path) -> None:
    """Turn a sound retention record into a hostile one."""
    data = path.read_bytes()
    if how == "symlink":
        path.unlink()
        path.symlink_to(victim / "precious.txt")
    elif how == "folder":
        path.unlink()
        path.mkdir()
    elif how == "fifo":
        path.unlink()
        os.mkfifo(path)
    elif how == "stranger":
        os.chown(path, STRANGER, STRANGER)
    elif how == "loose":
        os.chmod(path, 0o666)
    elif how == "short":
        path.write_bytes(data[:-1])
    elif how == "long":
        path.write_bytes(data + b"\x00" * 4096)
    elif how == "magic":
        path.write_bytes(b"XXXX" + data[4:])
    elif how == "other-digest":
        path.write_bytes(data[:4] + digest("someone-else") + data[36:])
    elif how == "nan":
        path.write_bytes(data[:36] + struct.pack("<d", math.nan))
    elif how == "negative":
        path.write_bytes(data[:36] + struct.pack("<d", -1.0))


HOSTILE_RECORDS = {
    "symlink": "symlink",
    "folder": "not_regular",
    "fifo": "not_regular",
    "stranger": "foreign_owner",
    "loose": "writable_by_others",
    "short": "wrong_size",
    "long": "wrong_size",
    "magic": "bad_retention",
    "other-digest": "bad_retention",
    "nan": "bad_retention",
    "negative": "bad_retention",
}


@pytest.mark.parametrize(("how", "reason"), HOSTILE_RECORDS.items(), ids=HOSTILE_RECORDS)
def test_a_hostile_retention_record_leaves_its_block_unretained(
    root: Path, victim: Path, how: str, reason: str
):
    _retained(root, "a")
    before = files_under(victim)
    _spoil(_record(root, "a"), how, victim)
    tier = DiskTier(root, 1 << 20)  # starts: a bad record costs its block's mark only
    assert tier.rejected_files == {reason: 1}
    assert tier.get([digest("a")]) == [value("a")]
    assert tier.retained_until(digest("a")) is None
    assert files_under(victim) == before  # a link's target is never read nor removed
    assert tier.retain(digest("a"), 3600.0)  # and it can be retained again
    still_works(tier)
    tier.close()
    again = DiskTier(root, 1 << 20)  # recorded, unless a folder we never remove is in the way
    assert (again.retained_until(digest("a")) is None) == (how == "folder")
    again.close()


def test_a_retention_record_without_its_block_is_removed(root: Path):
    _retained(root, "a")
    block_file(root, "a").unlink()
    tier = DiskTier(root, 1 << 20)
    assert len(tier) == 0 and not _record(root, "a").exists()
    assert tier.rejected_files == {}
    tier.close()
