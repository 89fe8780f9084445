"""`prefixcache ray` on a two-node Ray cluster on loopback, as a user runs it.

Ray's own ``Cluster`` utility starts two nodes of one CPU each, every service on
127.0.0.1 (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` before Ray is imported keeps a local
cluster off the host's address). The tests share one deployment and run in file order:
autoscaling from one replica to two (the added one warm from the tier), placement, routing,
a SIGKILLed replica, its successor warm from the tier, 503 while no replica is up, and a
shutdown that leaves no process of ours; then Ray's own routing, in a second deployment.
"""

from __future__ import annotations

import os

import loopback

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before ray is imported

import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai
import psutil
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.cluster_utils import Cluster

from prefixcache.protocol.tenant_secret import load_or_create_secret
from process_fixtures import read_lines, wait_for
from router_fixtures import write_tiny_hf_model
from server_fixtures import free_port

pytestmark = pytest.mark.slow

MODEL = "tiny-hf"
BLOCK = 16
DOCUMENT = "Pier four's ferry leaves at noon; the cafe on board sells tea and toast. " * 12
# documents no replica has seen before their test: one holder, whatever came earlier
SECRET_DOCUMENT = "The lighthouse keeper logs each passing ship by name and hour. " * 12
KILL_DOCUMENT = "Night buses wait at the square until the last ferry has docked. " * 12
FRESH_DOCUMENT = "Harbour tickets are stamped at the kiosk beside the fish market. " * 12
APP = "prefixcache"
ENGINE = "PrefixcacheEngine"


@dataclass
class Deployed:
    process: subprocess.Popen
    url: str
    lines: list[str]
    cluster: Cluster
    first: set[str]  # the replica ids before one was killed
    secret: str = ""  # the tenant secret, in hex

    def members(self) -> list[dict]:
        """The replicas the ingress routes over now (asked through Ray, as a driver)."""
        return serve.get_app_handle(APP).replicas.remote().result(timeout_s=30)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two nodes of one CPU each, and this process connected to them as a driver."""
    nodes = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    nodes.add_node(num_cpus=1)
    ray.init(address=nodes.address, log_to_driver=False)
    nodes.model = write_tiny_hf_model(tmp_path_factory.mktemp("ray") / MODEL)
    yield nodes
    ray.shutdown()
    nodes.shutdown()


def deploy(cluster: Cluster, *flags: str) -> Deployed:
    """``prefixcache ray`` on the cluster, once it says it is ready."""
    port = free_port()
    command = [sys.executable, "-m", "prefixcache.cli", "ray", "--address", cluster.address]
    command += ["--port", str(port), "--model", str(cluster.model), *flags]
    command += ["--kv-tier", "redis://embedded", "--kv-cache-bytes", str(2**22)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = read_lines(process)
    try:
        ready = lambda: any("prefixcache ray: ready" in line for line in lines)  # noqa: E731
        wait_for(lambda: ready() or process.poll() is not None, "the deployment", 180)
        assert ready(), "".join(lines)
        ray.shutdown()  # a new driver session: Serve's cached controller may be a stopped one
        ray.init(address=cluster.address, log_to_driver=False)
    except BaseException:
        kill(process)
        raise
    return Deployed(process, f"http://127.0.0.1:{port}", lines, cluster, set())


def kill(process: subprocess.Popen) -> None:
    """A failed test's deployment: the command and its children, at once."""
    for child in psutil.Process(process.pid).children(recursive=True):
        child.kill()
    process.kill()
    process.wait()


def stop(deployed: Deployed) -> None:
    deployed.process.send_signal(signal.SIGTERM)
    assert deployed.process.wait(timeout=90) == 0, "".join(deployed.lines)


@pytest.fixture(scope="module")
def deployed(cluster, tmp_path_factory):
    secret = tmp_path_factory.mktemp("secret") / "tenant-secret"
    load_or_create_secret(secret)
    found = deploy(
        cluster, "--replicas", "1", "--min-replicas", "1", "--max-replicas", "2",
        "--target-ongoing-requests", "1", "--upscale-delay", "1", "--autoscale-window", "2",
        "--tenant-secret-file", str(secret),
    )  # fmt: skip
    found.secret = secret.read_text().split()[0]
    try:
        yield found
    finally:
        if found.process.poll() is None:
            kill(found.process)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def ask(url: str, question: str, stream: bool = False, tokens: int = 3, document=DOCUMENT):
    """A completion of the document and a question: (its headers, its usage)."""
    prompt, exact = document + question, {"ignore_eos": True}
    if stream:
        with client(url).completions.with_streaming_response.create(
            model=MODEL, prompt=prompt, max_tokens=tokens, stream=True,
            stream_options={"include_usage": True}, extra_body=exact,
        ) as response:  # fmt: skip
            chunks = list(response.parse())
            return response.headers, chunks[-1].usage
    raw = client(url).completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=tokens, extra_body=exact
    )
    return raw.headers, raw.parse().usage


def router_retries(url: str) -> float:
    text = loopback.get(f"{url}/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "prefixcache_router_retries_total"
    )


def tier_tokens(url: str) -> float:
    text = loopback.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (
                sample.name == "prefixcache_cached_tokens_total"
                and sample.labels["source"] == "tier"
            ):
                return sample.value
    raise AssertionError("no tier counter in /metrics")


def full_blocks(usage) -> int:
    return usage.prompt_tokens // BLOCK * BLOCK


# Tokens a load request asks for. Ray adds a replica once the engines' mean running + waiting
# requests passes 1 (the target); two looping clients reach that only while their requests
# spend most of their life in the engine. With 48 tokens, served straight, the mean was 1.64
# (1.72 before this stop's faster decode steps), less through Ray's proxy and our router, and
# a full run once timed out waiting for the scale-up; with 160 it is 1.88.
LOAD_TOKENS = 160


def test_ray_adds_a_replica_under_load_and_it_starts_warm_from_the_tier(deployed):
    (first,) = deployed.members()  # --replicas 1, autoscaling up to 2 at one request each
    assert any("ready: 1 replicas on 1 nodes" in line for line in deployed.lines)
    done = threading.Event()

    def load(worker: int) -> None:
        number = 0
        while not done.is_set():  # in the engine most of its life, not in transit
            ask(deployed.url, f"Load {worker}.{number}: which pier?", tokens=LOAD_TOKENS)
            number += 1

    def deciding() -> bool:  # the load has done its part once Ray decides to scale up
        engine = serve.status().applications[APP].deployments[ENGINE]
        return engine.status == "UPSCALING" or len(deployed.members()) == 2

    with ThreadPoolExecutor(2) as pool:  # two at a time: twice the target of one
        workers = [pool.submit(load, worker) for worker in range(2)]
        try:
            wait_for(deciding, "Ray to decide to add a replica", 120)
        finally:
            done.set()
        for worker in workers:
            worker.result()  # every request under load was answered
    wait_for(lambda: len(deployed.members()) == 2, "the added replica to register", 120)
    (added,) = [m for m in deployed.members() if m["replica"] != first["replica"]]
    _, usage = ask(added["url"], "A first question on the added replica?")
    assert usage.prompt_tokens_details.cached_tokens >= full_blocks(usage) - BLOCK
    assert tier_tokens(added["url"]) == usage.prompt_tokens_details.cached_tokens


def test_replicas_land_on_both_nodes_and_say_so_in_their_headers(deployed):
    members = deployed.members()
    nodes = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    assert len(members) == 2 and {m["node"] for m in members} == nodes
    headers, _ = ask(deployed.url, "Who runs the cafe?")
    by_url = {m["url"]: m for m in members}
    member = by_url[headers["x-prefixcache-replica"]]
    assert headers["x-prefixcache-node"] == member["node"]
    assert headers["x-prefixcache-ray-replica"] == member["replica"]


def test_the_tenant_secret_reaches_the_replicas_through_ray_and_no_log_or_command_line(
    deployed,
):
    first, _ = ask(deployed.url, "Is the secret shared?", document=SECRET_DOCUMENT)
    again, usage = ask(deployed.url, "Is it shared, twice?", document=SECRET_DOCUMENT)
    assert usage.prompt_tokens_details.cached_tokens > 0
    assert again["x-prefixcache-replica"] == first["x-prefixcache-replica"]
    session = Path(deployed.cluster.head_node.get_session_dir_path())
    logs = [path for path in session.rglob("*") if path.is_file() and path.stat().st_size < 2**26]
    assert logs and not [path for path in logs if deployed.secret.encode() in path.read_bytes()]
    for process in psutil.process_iter(["cmdline"]):
        assert deployed.secret not in " ".join(process.info["cmdline"] or [])


def test_a_documents_requests_go_to_the_replica_that_holds_it(deployed):
    first, _ = ask(deployed.url, "When does it open?", document=FRESH_DOCUMENT)
    holder = first["x-prefixcache-replica"]
    for number, stream in enumerate((False, True, False)):
        question = f"Question {number}: is there a queue?"
        headers, usage = ask(deployed.url, question, stream, document=FRESH_DOCUMENT)
        assert headers["x-prefixcache-replica"] == holder
        assert usage.prompt_tokens_details.cached_tokens >= full_blocks(usage) - BLOCK


def test_a_sigkilled_replica_loses_no_request_and_ray_brings_it_back(deployed):
    holder, _ = ask(deployed.url, "Where is pier four?", document=KILL_DOCUMENT)
    members = deployed.members()
    deployed.first = {member["replica"] for member in members}
    victim = next(m for m in members if m["url"] == holder["x-prefixcache-replica"])
    retries = router_retries(deployed.url)
    with ThreadPoolExecutor(8) as pool:  # long answers: in flight on the victim when it dies
        answers = [
            pool.submit(ask, deployed.url, f"Seat {n}?", tokens=250, document=KILL_DOCUMENT)
            for n in range(8)
        ]
        time.sleep(0.5)
        os.kill(victim["pid"], signal.SIGKILL)
        assert all(answer.result()[1].completion_tokens == 250 for answer in answers)
    assert router_retries(deployed.url) > retries  # answered by the other replica
    wait_for(lambda: not psutil.pid_exists(victim["server_pid"]), "the server to die with it")

    def replaced() -> bool:
        members = deployed.members()
        return len(members) == 2 and victim["replica"] not in {m["replica"] for m in members}

    wait_for(replaced, "Ray to start a replica in its place")


def test_the_new_replicas_first_request_for_a_known_document_is_a_tier_hit(deployed):
    (newcomer,) = [m for m in deployed.members() if m["replica"] not in deployed.first]
    assert tier_tokens(newcomer["url"]) == 0
    _, usage = ask(newcomer["url"], "A first question on this replica?")
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached >= full_blocks(usage) - BLOCK
    assert tier_tokens(newcomer["url"]) == cached


def test_while_no_replica_is_up_the_ingress_answers_503_with_a_reason(deployed):
    members = deployed.members()
    servers = [psutil.Process(member["server_pid"]) for member in members]
    for member in members:
        os.kill(member["pid"], signal.SIGKILL)
    # The kernel kills a replica's server (its parent-death signal) only once the actor's exit
    # is done, which takes a large process a moment: until then the server still answers.
    _, alive = psutil.wait_procs(servers, timeout=30)
    assert not alive
    response = loopback.post(
        f"{deployed.url}/v1/completions",
        json={"model": MODEL, "prompt": DOCUMENT, "max_tokens": 1},
        timeout=60,
    )
    assert response.status_code == 503
    assert "no replica" in response.json()["error"]["message"]

    def back() -> bool:
        health = loopback.get(f"{deployed.url}/health", timeout=5).json()
        return sum(r["healthy"] for r in health["replicas"]) == 2

    wait_for(back, "both replicas to come back")


def test_shutdown_leaves_no_process_of_ours(deployed):
    cli = psutil.Process(deployed.process.pid)
    ours = cli.children(recursive=True)  # the embedded redis-server
    for member in deployed.members():
        ours += [psutil.Process(member["pid"]), psutil.Process(member["server_pid"])]
    port = deployed.url.rsplit(":", 1)[1]
    for process in psutil.process_iter(["cmdline"]):
        line = process.info["cmdline"] or []
        if "route" in line and port in line:
            ours.append(process)  # the router, under the ingress actor
    assert len(ours) >= 6
    stop(deployed)
    _, alive = psutil.wait_procs(ours, timeout=30)
    assert not alive, f"left running: {[p.pid for p in alive]}"
    assert any("prefixcache ray: stopped" in line for line in deployed.lines)


def test_under_rays_own_routing_the_proxy_serves_and_headers_name_node_and_replica(cluster):
    plain = deploy(cluster, "--replicas", "1", "--routing", "ray")
    try:
        nodes = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
        for number in range(4):
            headers, usage = ask(plain.url, f"Ray's router, question {number}?", stream=number % 2)
            assert usage.completion_tokens == 3
            assert headers["x-prefixcache-node"] in nodes
            assert headers["x-prefixcache-replica"].startswith("http://127.0.0.1:")
    finally:
        stop(plain)
