"""The API fuzzer at nightly size: schemathesis over every operation, many examples.

The same run as ``tests/test_fuzz_api.py`` (``tests/fuzz_fixtures.py``) against the same
live server (uvicorn on loopback, the tiny random-weight model, a key file), only longer.
Not a test: run it by hand or from a nightly job; it exits 1 on the first failure, with the
case that caused it.

    .venv/bin/python benchmarks/fuzz_nightly.py --examples 2000
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from engine_fixtures import assert_pool_clean, tiny_engine
from fuzz_fixtures import fuzz
from prefixcache.protocol.auth import Tenants
from server_fixtures import running_server, wait_idle, write_key_file

ADMIN = {"authorization": "Bearer sk-alpha"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=int, default=1000, help="per operation and mode")
    args = parser.parse_args()
    engine = tiny_engine(num_kv_blocks=512, max_num_seqs=16)
    with tempfile.TemporaryDirectory() as folder:
        tenants = Tenants.from_file(write_key_file(Path(folder)))
        with running_server(engine, tenants, max_pending=64) as (url, state):
            started = time.monotonic()
            ran = fuzz(url, ADMIN, args.examples)
            wait_idle(state)
    assert_pool_clean(engine)
    took = time.monotonic() - started
    print(f"fuzz: {len(ran)} operation x mode runs, {args.examples} examples each, no failure")
    print(f"fuzz: {took:.0f} s; engine saw {engine.manager.stats.requests} requests; pool clean")
    return 0


if __name__ == "__main__":
    sys.exit(main())
