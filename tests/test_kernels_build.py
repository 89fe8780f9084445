"""The native kernels' build refuses cleanly: a missing or failing compiler is a BuildError
naming it, and nothing half-built stays in the cache folder."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from prefixcache.engine import kernels


@pytest.mark.parametrize(
    ("compiler", "said"),
    [
        ("no-such-compiler-here", "no C++ compiler ('no-such-compiler-here'"),
        ("false", "false failed"),
    ],
)
def test_a_build_that_cannot_run_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compiler: str, said: str
) -> None:
    monkeypatch.setenv("CXX", compiler)
    target = tmp_path / "kernels" / "library.so"
    with pytest.raises(kernels.BuildError, match=re.escape(said)):
        kernels.build(target)
    assert not target.exists()
    assert not target.parent.exists() or not list(target.parent.iterdir())  # no temporary
