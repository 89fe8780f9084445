"""`prefixcache ray` with a local Ray of its own, stopped once it serves: Ctrl-C (SIGINT to
its group) ends it within its deadline with status 0 (SIGTERM: test_ray_serve.py), a second Ctrl-C
during the teardown with 130; no traceback, and none of its processes left (Ray's GCS,
raylet, workers and actors, the replicas' servers, the router, redis-server), read from
/proc (issue 38). Each cell starts its own Ray (~15 s): two at a time.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from prefixcache.on_ray.cli import STOP_SECONDS
from process_fixtures import descendants, send
from router_fixtures import wait_until, write_tiny_hf_model
from server_fixtures import free_port
from stop_fixtures import (
    Outcome,
    assert_clean,
    launch,
    nothing_left_running,  # noqa: F401 - a fixture the tests use
    prefixcache,
    run_cells,
    settle,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("nothing_left_running")]
DEADLINE = STOP_SECONDS + 5.0
RAY_PARTS = ("gcs_server", "raylet", "ServeController", "ServeReplica", " serve ", " route ")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny_hf_model(tmp_path_factory.mktemp("ray-stop") / "tiny")


def ray_command(model: Path) -> list[str]:
    return prefixcache(
        "ray", "--port", str(free_port()), "--model", str(model), "--replicas", "1",
        "--local-cpus", "2", "--kv-tier", "redis://embedded", "--kv-cache-bytes", str(2**22),
    )  # fmt: skip


def ray_cell(work: Path, model: Path, sig: int, group: bool, twice: bool = False) -> Outcome:
    """Signal it once it is ready (and, ``twice``, again once the teardown began)."""
    log = work / f"ray-{time.monotonic_ns()}.log"
    process = launch(ray_command(model), log)  # a local Ray: on loopback only (the CLI's)
    wait_until(lambda: "prefixcache ray: ready" in log.read_text() or process.poll() is not None,
               180, "the deployment")  # fmt: skip
    assert process.poll() is None, log.read_text()[-3000:]
    family = descendants(process.pid)
    kinds = [part for part in RAY_PARTS if any(part in c for c in family.values())]
    assert len(kinds) == len(RAY_PARTS) and "redis-server" in str(family), family
    send(process, sig, group)
    if twice:
        wait_until(lambda: "Deleting app" in log.read_text(), 30, "the teardown")
        send(process, sig, group)
    outcome = settle(process, log, sig, group, family, DEADLINE)
    assert twice == ("second signal: stopping now" in log.read_text()), log.read_text()[-3000:]
    return outcome


def test_ray_stops_on_ctrl_c_and_a_second_ctrl_c(tmp_path, model) -> None:
    """Two Ray starts at once (one round): SIGTERM to the process is test_ray_serve.py's
    `stop` (status 0, no process left), on a Ray cluster of its own."""
    cells = [(signal.SIGINT, True, False), (signal.SIGINT, True, True)]
    outcomes = run_cells(cells, lambda *cell: ray_cell(tmp_path, model, *cell))
    assert_clean(outcomes[:1])
    cut = outcomes[1]
    assert cut.status == 130 and not cut.left and not cut.traceback, cut
