"""`prefixcache cluster` as a user runs it: replicas, an embedded Redis, a router, Ctrl-C."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx
import psutil
import pytest

import loopback
from process_fixtures import read_lines, wait_for
from router_fixtures import write_tiny_hf_model
from server_fixtures import free_port


def healthy(url: str) -> bool:
    try:
        return loopback.get(f"{url}/health", timeout=2).status_code == 200
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


def early_503s(url: str, seen: list[dict]) -> bool:
    """Healthy yet? Keeps each 503 error the router gave while its replicas loaded."""
    try:
        response = loopback.get(f"{url}/v1/models", timeout=2)
    except httpx.HTTPError:
        return False
    if response.status_code == 503:
        seen.append(response.json()["error"])
    return response.status_code == 200


def ask(url: str) -> httpx.Response:
    body = {"model": "tiny-hf", "prompt": "The ferry leaves at noon from pier four. " * 8}
    return loopback.post(f"{url}/v1/completions", json={**body, "max_tokens": 2}, timeout=60)


@pytest.mark.slow
def test_a_cluster_routes_restarts_a_dead_replica_and_stops_on_one_ctrl_c(tmp_path):
    model = write_tiny_hf_model(tmp_path / "tiny-hf")
    port = free_port()
    command = [sys.executable, "-m", "prefixcache.cli", "cluster", "--replicas", "2"]
    command += ["--port", str(port), "--model", str(model), "--kv-tier", "redis://embedded"]
    command += ["--kv-cache-bytes", str(2**22)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    cluster = psutil.Process(process.pid)
    lines = read_lines(process)
    url = f"http://127.0.0.1:{port}"
    ready = f"prefixcache cluster: ready: 2/2 replicas healthy at {url} after "
    not_ready: list[dict] = []
    try:
        wait_for(lambda: early_503s(url, not_ready), "the router")
        for error in not_ready:  # the replicas load slower than the router: usually some
            assert error["message"].startswith("no replica is ready yet (0 of 2 healthy")
            assert "127.0.0.1" not in error["message"]
        wait_for(lambda: sum(ready in line for line in lines) == 1, "both replicas to join")
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
        wait_for(lambda: sum(ready in line for line in lines) == 2, "the restarted one to rejoin")
        everyone = cluster.children(recursive=True)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
        output = "".join(lines)
        assert "exited with" in output and "restarting" in output
        assert "prefixcache cluster: 1/2 replicas healthy" in output  # the killed one left
        assert output.index("waiting for 2 replicas to load the model") < output.index(ready)
        _, alive = psutil.wait_procs(everyone, timeout=10)
        assert not alive, f"children left running: {alive}"
    finally:
        if process.poll() is None:
            for child in cluster.children(recursive=True):
                child.kill()
            process.kill()


REPLICA_FLAGS = ["--retention-budget", "0.3", "--kv-cache-dtype", "int8", "--step-target-ms", "100"]


def test_the_cluster_passes_its_replica_options_to_every_replica(tmp_path):
    import argparse

    from prefixcache.router.cluster import add_cluster_parser, plan_cluster

    parser = argparse.ArgumentParser()
    add_cluster_parser(parser.add_subparsers(dest="command"))
    plan = plan_cluster(parser.parse_args(["cluster", "--replicas", "2", *REPLICA_FLAGS]), tmp_path)
    for replica in plan.replicas:
        assert_passed_on(replica.command)
    for bad in (["--retention-budget", "1.5"], ["--step-target-ms", "-1"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["cluster", *bad])


def test_ray_passes_the_same_replica_options() -> None:
    import argparse

    from prefixcache.on_ray.cli import _serve_flags, add_ray_parser

    parser = argparse.ArgumentParser()
    add_ray_parser(parser.add_subparsers(dest="command"))
    assert_passed_on(list(_serve_flags(parser.parse_args(["ray", *REPLICA_FLAGS]))))


def assert_passed_on(command: list[str]) -> None:
    """Each of ``REPLICA_FLAGS`` with its value, and ``serve`` itself takes them."""
    from prefixcache.cli import build_parser

    for flag, value in zip(REPLICA_FLAGS[::2], REPLICA_FLAGS[1::2], strict=True):
        assert command[command.index(flag) + 1] == value
    serve = build_parser(only_serve=True).parse_args(["serve", *REPLICA_FLAGS])
    assert (serve.step_target_ms, serve.kv_cache_dtype) == (100, "int8")
