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


def test_a_march_from_the_environment_builds_a_library_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    native = kernels.library_path()
    monkeypatch.setenv(kernels.MARCH_VARIABLE, "x86-64-v3")
    assert "-march=x86-64-v3" in kernels.flags() and "-march=native" not in kernels.flags()
    assert kernels.library_path() != native  # never loads the native build for it


@pytest.mark.parametrize("value", ["native; rm -rf /", "x86-64-v3 -fplugin=evil.so", "$(id)"])
def test_a_march_that_is_not_a_name_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(kernels.MARCH_VARIABLE, value)
    with pytest.raises(kernels.BuildError, match=f"{kernels.MARCH_VARIABLE}=.*-march name"):
        kernels.flags()
