"""Native kernels (C++ on torch's ATen), built once per machine with the system compiler.

The sources sit beside this file. The library goes to `<cache folder>/kernels/<key>.so`, the
key a digest of the sources, torch's version, the flags and the CPU's features. `make serve`
and `make test` build it first (`python -m prefixcache.engine.kernels`); otherwise the first
use builds it (23 s on 2 cores: one compiler per core, each file parsing only the ATen
headers it uses). Without a compiler, or when the build fails, the engine keeps its eager
torch path and says so once in the log.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from types import ModuleType

import torch

from prefixcache.engine.cache_folder import default_cache_dir
from prefixcache.progress import progress_bar
from prefixcache.shutdown import kill_tree

SOURCES = (
    "ops.cpp",
    "decode_layer.cpp",
    "decode_layer.h",
    "gguf_avx2.h",
    "gguf_blocks.h",
    "gguf_int8.h",
    "gguf_matmul.cpp",
    "gguf_matmul.h",
    "gguf_panel.h",
    "gguf_simd.h",
    "gguf_simd_avx2.h",
    "head_logits.cpp",
    "head_logits.h",
    "kv_rows.cpp",
    "kv_rows.h",
    "round_bf16.cpp",
    "round_bf16.h",
)
FLAGS = ("-O3", "-march=native", "-std=c++20", "-shared", "-fPIC", "-fopenmp")
LINK_ONLY = ("-shared",)  # FLAGS an object file's compile leaves out
# `-march=` for another instruction set than this CPU's: `x86-64-v3` runs an AVX2 machine's
# kernels on an AVX-512 one (`benchmarks/peers.py --isa avx2`).
MARCH_VARIABLE = "PREFIXCACHE_KERNEL_MARCH"
_HERE = Path(__file__).resolve().parent

log = logging.getLogger(__name__)
_COMPILING: set[subprocess.Popen] = set()  # compiler drivers running now
_STARTING = threading.Lock()  # held to start a compiler, and to stop them all


class BuildError(RuntimeError):
    """The compiler is missing or refused the sources."""


def library_path(folder: Path | None = None) -> Path:
    """Where the library for these sources, this torch and this CPU lives."""
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update(name.encode() + b"\0" + (_HERE / name).read_bytes())
    digest.update(" ".join((torch.__version__, *flags(), _cpu_features())).encode())
    return (folder or default_cache_dir()) / "kernels" / f"prefixcache-{digest.hexdigest()[:24]}.so"


def flags() -> tuple[str, ...]:
    """The compiler's flags: FLAGS, with `-march=$PREFIXCACHE_KERNEL_MARCH` where it is set."""
    march = os.environ.get(MARCH_VARIABLE, "").strip()
    if not march:
        return FLAGS
    if not march.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise BuildError(f"{MARCH_VARIABLE}={march!r}: expected a -march name such as x86-64-v3")
    return tuple(f"-march={march}" if flag == "-march=native" else flag for flag in FLAGS)


def _cpu_features() -> str:
    """The CPU's flags line (-march=native compiles for them), or '' where unreadable."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line for line in lines if line.startswith("flags")), "")


def build(path: Path) -> Path:
    """Compile the library to `path` (atomically: a temporary file, then a rename): each
    source to an object file at once, as many at a time as there are cores, then a link."""
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        raise BuildError(f"no C++ compiler ({compiler!r} is not on PATH)")
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".objects-") as folder:
        objects = _compile_objects(compiler, Path(folder), temporary)
        lib = _cpp_extension().library_paths()[0]
        command = [compiler, *flags(), *objects, f"-L{lib}", f"-Wl,-rpath,{lib}"]
        command += ["-ltorch", "-ltorch_cpu", "-lc10", "-o", str(temporary)]
        _check(compiler, _compile(command, temporary, threading.Event()), temporary)
    os.replace(temporary, path)
    return path


def _cpp_extension() -> ModuleType:
    """torch's build helpers, imported for a build only (they import setuptools: ~0.1 s of
    every server's start-up otherwise)."""
    from torch.utils import cpp_extension

    return cpp_extension


def _compile_objects(compiler: str, folder: Path, temporary: Path) -> list[str]:
    """Every source compiled into ``folder``, ``os.cpu_count()`` compilers at a time."""
    compile_flags = [flag for flag in flags() if flag not in LINK_ONLY]
    includes = [f"-I{p}" for p in _cpp_extension().include_paths()]
    head = [compiler, *compile_flags, *includes]
    commands = {
        str(folder / f"{name}.o"): [*head, "-c", str(_HERE / name), "-o"]
        for name in SOURCES
        if name.endswith(".cpp")
    }
    pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="compile")
    stopping = threading.Event()
    try:
        running = [
            pool.submit(_compile, command + [target], temporary, stopping)
            for target, command in commands.items()
        ]
        with progress_bar(len(running), "compiling the native kernels", "file") as advance:
            for _done in as_completed(running):
                if advance is not None:
                    advance(1)
        results = [future.result() for future in running]
    except BaseException:  # Ctrl-C in this thread: no compiler starts or stays running
        stopping.set()  # before the kill: a worker past this point starts nothing
        pool.shutdown(wait=False, cancel_futures=True)
        _stop_compilers()
        raise
    pool.shutdown()
    for result in results:
        _check(compiler, result, temporary)
    return list(commands)


def _check(compiler: str, result: tuple[int, str], temporary: Path) -> None:
    """BuildError with the compiler's last words if it failed (no half-built file stays)."""
    returncode, errors = result
    if returncode != 0:
        temporary.unlink(missing_ok=True)
        raise BuildError(f"{compiler} failed: {errors.strip()[-2000:]}")


def _compile(command: list[str], temporary: Path, stopping: threading.Event) -> tuple[int, str]:
    """Run the compiler (in our process group: a terminal's Ctrl-C reaches it). If this
    thread is interrupted (Ctrl-C, SIGTERM), or the process exits while another thread
    builds, the driver and everything below it are killed: nothing outlives us, no
    half-built file stays. Once `stopping` is set, no compiler starts: a worker whose
    compiler the group's Ctrl-C killed would otherwise start the next one (unsignalled),
    and the exit would wait for it."""
    with _STARTING:
        if stopping.is_set():
            return 1, "the build was stopped"
        process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        _COMPILING.add(process)
    try:
        _, errors = process.communicate()
    except BaseException:
        kill_tree(process)
        temporary.unlink(missing_ok=True)
        raise
    finally:
        _COMPILING.discard(process)
    return process.returncode, errors


@atexit.register
def _stop_compilers() -> None:
    """At exit: no compiler of ours keeps running (a build in a thread the exit left)."""
    with _STARTING:
        for process in list(_COMPILING):
            kill_tree(process)


@functools.cache
def available() -> bool:
    """Load the library (building it if needed); False, logged once, if it cannot be."""
    try:
        path = library_path()
        if not path.exists():
            started = time.monotonic()
            build(path)
            log.info("built the native kernels in %.1f s: %s", time.monotonic() - started, path)
        torch.ops.load_library(str(path))
    except (BuildError, OSError) as error:
        log.warning("native kernels unavailable, decoding on the eager torch path: %s", error)
        return False
    return True


def simd_decoders() -> bool:
    """The native GGUF decoders are vectorized here (AVX2 or AVX-512): a packed matrix's
    one-row product then runs near memory speed (`kernels/gguf_simd*.h`)."""
    return available() and decoders() != "portable"


@functools.cache
def decoders() -> str:
    """The loaded library's decoders, "avx512", "avx2" or "portable" (`gguf_simd()`): fixed
    once it is loaded, and asked on every packed matmul (`packed_weight.row_limits`),
    so the op is called once. The library must be available."""
    return torch.ops.prefixcache.gguf_simd()
