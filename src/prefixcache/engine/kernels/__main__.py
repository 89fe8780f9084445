"""`python -m prefixcache.engine.kernels`: build the native kernels now (make serve, make test)."""

from __future__ import annotations

import sys

from prefixcache.engine.kernels import BuildError, build, library_path


def main() -> int:
    try:
        path = library_path()
        if path.exists():
            print(f"native kernels: {path} (built before)")
            return 0
        build(path)
    except BuildError as error:
        print(f"native kernels: {error}", file=sys.stderr)
        return 1
    print(f"native kernels: built {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
