"""The tenant secret file: created when absent, and a clear one-line error when it is not hex."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import pytest

from prefixcache.protocol.auth import load_or_create_secret

MAKE_ONE = 'python -c "import secrets; print(secrets.token_hex(32))" >'


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
    path = tmp_path / "secret"
    path.write_text(text)
    with pytest.raises(ValueError) as error:
        load_or_create_secret(path)
    message = str(error.value)
    assert message.startswith(f"tenant secret file {path}: {reason}")
    assert "64 hex digits (32 bytes)" in message and f"{MAKE_ONE} {path}" in message
    assert "does not exist" in message and "fromhex" not in message


@pytest.mark.parametrize("command", ["serve", "route"])
def test_the_cli_refuses_it_in_one_line_with_exit_code_2(tmp_path: Path, command: str) -> None:
    path = tmp_path / "secret"
    path.write_text("zz" * 32)
    argv = [sys.executable, "-m", "prefixcache.cli", command, "--tenant-secret-file", str(path)]
    if command == "route":
        argv += ["--replica", "http://127.0.0.1:9", "--policy", "round-robin"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.startswith(
        f"prefixcache {command}: tenant secret file {path}: not a hex string"
    )
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
