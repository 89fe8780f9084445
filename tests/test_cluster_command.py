"""`prefixcache cluster` as a user runs it: replicas, an embedded Redis, a router, Ctrl-C."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from router_fixtures import write_tiny_hf_model
from server_fixtures import free_port


def wait_for(predicate, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def replicas_of(cluster: psutil.Process) -> list[psutil.Process]:
    """The live replica processes (a killed one is a zombie until the cluster reaps it)."""
    live = []
    for child in cluster.children():
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "serve" in child.cmdline():
                live.append(child)
        except psutil.Error:
            continue
    return live


def ask(url: str) -> httpx.Response:
    body = {"model": "tiny-hf", "prompt": "The ferry leaves at noon from pier four. " * 8}
    return httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 2}, timeout=60)


@pytest.mark.slow
def test_a_cluster_routes_restarts_a_dead_replica_and_stops_on_one_ctrl_c(tmp_path):
    model = write_tiny_hf_model(tmp_path / "tiny-hf")
    port = free_port()
    command = [sys.executable, "-m", "prefixcache.cli", "cluster", "--replicas", "2"]
    command += ["--port", str(port), "--model", str(model), "--kv-tier", "redis://embedded"]
    command += ["--kv-cache-bytes", str(2**22)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    cluster = psutil.Process(process.pid)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: healthy(url), "the router")
        answer = ask(url)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-prefixcache-replica"].startswith("http://127.0.0.1:")
        children = cluster.children()
        names = [" ".join(c.cmdline()) for c in children]
        assert sum("redis-server" in n for n in names) == 1 and len(replicas_of(cluster)) == 2
        victim = replicas_of(cluster)[0]
        victim.kill()
        wait_for(lambda: len(replicas_of(cluster)) == 2 and victim not in cluster.children(),
                 "the restart")  # fmt: skip
        assert ask(url).status_code == 200  # the other replica serves meanwhile, or both
        everyone = cluster.children(recursive=True)
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=60)
        assert process.returncode == 0
        assert "exited with" in output and "restarting" in output
        _, alive = psutil.wait_procs(everyone, timeout=10)
        assert not alive, f"children left running: {alive}"
    finally:
        if process.poll() is None:
            for child in cluster.children(recursive=True):
                child.kill()
            process.kill()
