"""Health checks stay out of the access log of ``prefixcache serve`` and ``prefixcache route``."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import loopback
from prefixcache.protocol.access_log import HealthCheckFilter, ResponseIdFilter
from router_fixtures import ReplicaProcess, write_tiny_hf_model
from server_fixtures import free_port


def wait_for(predicate: Callable[[], bool], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def access_record(path: str) -> logging.LogRecord:
    """An access-log record as uvicorn makes it."""
    args = ("127.0.0.1:5000", "GET", path, "1.1", 200)
    return logging.LogRecord(
        "uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d', args, None
    )


def test_the_filter_drops_health_and_metrics_only() -> None:
    keep = HealthCheckFilter().filter
    assert not keep(access_record("/health")) and not keep(access_record("/metrics?x=1"))
    assert keep(access_record("/v1/models")) and keep(access_record("/healthz"))


def test_a_stored_response_id_never_reaches_the_access_log() -> None:
    redact = ResponseIdFilter().filter
    cases = {
        "/v1/responses/resp_1234abcd99": "/v1/responses/{id}",
        "/v1/responses/resp_x/input_items?after=msg_1": "/v1/responses/{id}/input_items",
        "/v1/responses": "/v1/responses",
        "/tokenize": "/tokenize",
    }
    for path, logged in cases.items():
        record = access_record(path)
        assert redact(record)
        assert record.getMessage() == f'127.0.0.1:5000 - "GET {logged} HTTP/1.1" 200'


@pytest.mark.slow
def test_serve_logs_v1_models_but_not_health(tmp_path: Path) -> None:
    replica = ReplicaProcess(write_tiny_hf_model(tmp_path / "tiny-hf"), tmp_path)
    try:
        replica.start().wait_ready()  # polls /health itself
        assert loopback.get(f"{replica.url}/health").status_code == 200
        assert loopback.get(f"{replica.url}/v1/models").status_code == 200
    finally:
        replica.stop()
    log = replica.log_path.read_text()
    assert '"GET /v1/models HTTP/1.1" 200' in log
    assert "GET /health" not in log


def route_log(tmp_path: Path, *flags: str) -> str:
    """A router over a replica that is not there: its output after /health and /v1/models."""
    port = free_port()
    command = [sys.executable, "-m", "prefixcache.cli", "route", "--port", str(port)]
    command += ["--replica", f"http://127.0.0.1:{free_port()}", "--policy", "round-robin", *flags]
    log_path = tmp_path / f"route-{port}.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: "Uvicorn running" in log_path.read_text(), "the router", timeout=60)
        assert loopback.get(f"{url}/health").status_code == 503
        assert loopback.get(f"{url}/v1/models").status_code == 503
        wait_for(lambda: "/v1/models" in log_path.read_text(), "the access log line", timeout=10)
    finally:
        process.terminate()
        process.wait(10)
    return log_path.read_text()


@pytest.mark.slow
def test_route_leaves_health_checks_out_unless_asked(tmp_path: Path) -> None:
    quiet = route_log(tmp_path)
    assert '"GET /v1/models HTTP/1.1" 503' in quiet and "GET /health" not in quiet
    loud = route_log(tmp_path, "--log-health-checks")
    assert '"GET /health HTTP/1.1" 503' in loud
