"""The article's lab, through the console script and in process."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from prefixcache.cli import main

ARTICLE = ["same prefix: (2, 8)", "one token changed: (1, 4)", "different salt: (0, 0)"]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    script = shutil.which("prefixcache")
    command = [script] if script else [sys.executable, "-m", "prefixcache.cli"]
    return subprocess.run([*command, *args], capture_output=True, text=True, check=False)


def test_console_script_prints_the_article_lines_exactly():
    result = run_cli("lab")
    assert result.returncode == 0
    assert result.stdout.splitlines() == ARTICLE


@pytest.mark.parametrize(
    ("args", "lines"),
    [
        (
            ["--block-size", "2"],
            ["same prefix: (4, 8)", "one token changed: (3, 6)", "different salt: (0, 0)"],
        ),
        (["--no-salt"], ARTICLE[:2] + ["different salt: (2, 8)"]),
    ],
)
def test_variations(capsys, args, lines):
    assert main(["lab", *args]) == 0
    assert capsys.readouterr().out.splitlines() == lines


def test_bad_block_size_is_a_usage_error_not_a_traceback():
    result = run_cli("lab", "--block-size", "0")
    assert result.returncode == 2
    assert "0 must be >= 1" in result.stderr and "Traceback" not in result.stderr
