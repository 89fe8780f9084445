"""The tenant secret file: created when absent, refused when others may read it or it is not
hex, always with a clear one-line error."""

from __future__ import annotations

import argparse
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from prefixcache.protocol.tenant_secret import load_or_create_secret

MAKE_ONE = 'python -c "import secrets; print(secrets.token_hex(32))" >'


def private_file(path: Path, text: str, mode: int = 0o600) -> Path:
    """``text`` in a new file of ``mode`` (whatever the umask)."""
    path.write_text(text)
    path.chmod(mode)
    return path


def test_a_missing_file_is_created_owner_only_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "new" / "secret"
    secret = load_or_create_secret(path)
    assert len(secret) == 32 and path.read_text() == secret.hex() + "\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create_secret(path) == secret


@pytest.mark.parametrize(
    ("text", "reason"),
    [("not hex\n", "not a hex string"), ("abc\n", "not a hex string"), ("abcdef\n", "3 bytes")],
)
def test_a_bad_file_names_itself_the_format_and_how_to_make_one(
    tmp_path: Path, text: str, reason: str
) -> None:
    path = private_file(tmp_path / "secret", text)
    with pytest.raises(ValueError) as error:
        load_or_create_secret(path)
    message = str(error.value)
    assert message.startswith(f"tenant secret file {path}: {reason}")
    assert "64 hex digits (32 bytes)" in message and f"{MAKE_ONE} {path}" in message
    assert "does not exist" in message and "fromhex" not in message


def refusal(tmp_path: Path, command: str, text: str, mode: int = 0o600) -> tuple[Path, str]:
    """A secret file of ``text`` and ``mode`` given to ``command``: its path and one-line error."""
    path = private_file(tmp_path / "secret", text, mode)
    argv = [sys.executable, "-m", "prefixcache.cli", command, "--tenant-secret-file", str(path)]
    if command == "route":
        argv += ["--replica", "http://127.0.0.1:9", "--policy", "round-robin"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    return path, result.stderr


@pytest.mark.parametrize("command", ["serve", "route"])
def test_the_cli_refuses_it_in_one_line_with_exit_code_2(tmp_path: Path, command: str) -> None:
    path, error = refusal(tmp_path, command, "zz" * 32)
    assert error.startswith(f"prefixcache {command}: tenant secret file {path}: not a hex string")


@pytest.mark.parametrize(
    ("mode", "who"),
    [
        (0o644, "group can read it, others can read it"),
        (0o640, "group can read it"),
        (0o666, "group can read and write it, others can read and write it"),
        (0o602, "others can write it"),
    ],
)
def test_a_secret_others_may_read_or_write_is_refused_with_the_fix(
    tmp_path: Path, mode: int, who: str
) -> None:
    path = private_file(tmp_path / "secret", "ab" * 32 + "\n", mode)
    with pytest.raises(ValueError) as error:
        load_or_create_secret(path)
    assert str(error.value) == (
        f"tenant secret file {path}: {who} (mode {mode:04o}); whoever reads it can compute "
        f"every tenant's cache salt. Run: chmod 600 {path}"
    )
    path.chmod(0o600)
    assert load_or_create_secret(path) == bytes.fromhex("ab" * 32)


def test_a_symlink_a_fifo_or_a_foreign_file_is_never_used(tmp_path: Path) -> None:
    real = private_file(tmp_path / "real", "ab" * 32)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(ValueError, match=f"tenant secret file {link}: cannot open it"):
        load_or_create_secret(link)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(ValueError, match="not a regular file"):
        load_or_create_secret(fifo)  # returns at once: opened non-blocking, never read
    os.chown(real, 12345, 12345)
    with pytest.raises(ValueError, match=r"owned by uid 12345, not by this user .*chown"):
        load_or_create_secret(real)


def test_a_created_secret_is_owner_only_whatever_the_umask(tmp_path: Path) -> None:
    previous = os.umask(0)
    try:
        path = tmp_path / "tier" / "made"
        load_or_create_secret(path)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700  # e.g. a disk tier's folder


def test_route_refuses_a_world_readable_secret_in_one_line(tmp_path: Path) -> None:
    path, error = refusal(tmp_path, "route", "ab" * 32, 0o644)
    assert error.startswith(f"prefixcache route: tenant secret file {path}: group can read")
    assert error.rstrip().endswith(f"Run: chmod 600 {path}")


def test_a_shared_tier_without_a_secret_is_warned_about(tmp_path: Path, capsys) -> None:
    from prefixcache.server.cli import SHARED_TIER_WITHOUT_SECRET, tenant_secrets

    redis = argparse.Namespace(tenant_secret_file=None, kv_tier="redis://127.0.0.1:6379/0")
    assert tenant_secrets(redis) is None
    assert SHARED_TIER_WITHOUT_SECRET in capsys.readouterr().err
    assert "cold after every restart" in SHARED_TIER_WITHOUT_SECRET
    disk = argparse.Namespace(tenant_secret_file=None, kv_tier=f"disk:{tmp_path / 'tier'}")
    given = argparse.Namespace(tenant_secret_file=str(tmp_path / "s"), kv_tier=redis.kv_tier)
    assert len(tenant_secrets(disk).current) == len(tenant_secrets(given).current) == 32
    assert capsys.readouterr().err == ""


def test_cluster_refuses_a_bad_secret_once_before_starting_any_child(tmp_path: Path) -> None:
    path = private_file(tmp_path / "secret", "ab" * 32, 0o644)
    argv = [sys.executable, "-m", "prefixcache.cli", "cluster", "--tenant-secret-file", str(path)]
    argv += ["--replicas", "2", "--port", "0"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "chmod 600" in result.stderr
    assert result.stderr.startswith(f"prefixcache cluster: tenant secret file {path}")
    assert "replica" not in result.stdout.lower()  # nothing was started


def test_a_tier_spec_can_come_from_the_environment(monkeypatch) -> None:
    from prefixcache.router.cluster import TIER_ENV, plan_cluster
    from prefixcache.server.cli import resolve_tier_spec

    monkeypatch.setenv("TIER_SPEC", "redis://:pw@127.0.0.1:1/0")
    assert resolve_tier_spec("env:TIER_SPEC") == "redis://:pw@127.0.0.1:1/0"
    assert resolve_tier_spec("disk:/x") == "disk:/x" and resolve_tier_spec(None) is None
    with pytest.raises(ValueError, match="environment variable NOPE is not set"):
        resolve_tier_spec("env:NOPE")
    args = argparse.Namespace(
        tenant_secret_file=None, kv_tier="redis://:pw@127.0.0.1:1/0", replicas=2, threads=1,
        model=None, api_key_file=None, kv_cache_bytes=None, host="127.0.0.1", port=0,
        policy="cache-aware", retention_budget=None, kv_cache_dtype=None,
    )  # fmt: skip
    plan = plan_cluster(args, Path("/nonexistent"))
    for replica in plan.replicas:  # the password is in the child's environment, not its argv
        assert "pw" not in " ".join(replica.command) and f"env:{TIER_ENV}" in replica.command
        assert replica.env == {TIER_ENV: args.kv_tier}
