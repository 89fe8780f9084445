"""``prefixcache top`` against real ``prefixcache serve`` replicas (the tiny model, a key file)
and a real ``prefixcache route`` over them: one frame (``--once``), the live view in a real
terminal (tmux: start, read the screen, press ``q``), the admin key, and a replica that is
killed and comes back while the router view runs.

tmux is required (/usr/bin/tmux on Debian: ``apt-get install tmux``); without it these
tests fail, saying so, rather than skip.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import loopback
from prefixcache.protocol.auth import Tenants
from prefixcache.router.digests import prompt_digests
from router_fixtures import ReplicaProcess, tiny_replicas, wait_until
from router_process import RouterProcess

ADMIN_KEY = "sk-alpha"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
DOCUMENT = "Document zebrafinch. " + " ".join(f"zebrafinch{i}" for i in range(24))
QUESTIONS = ("Who?", "What is kept in it and why?", "Where is it kept, and since when exactly?")
TOP = [sys.executable, "-m", "prefixcache.cli", "top"]


@dataclass
class Servers:
    replicas: list[ReplicaProcess]
    tenants: Tenants
    router: RouterProcess


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    work = tmp_path_factory.mktemp("top")
    with tiny_replicas(work) as (replicas, tenants, _):
        keys = ("--api-key-file", str(work / "keys.json"), "--policy", "round-robin")
        router = RouterProcess([r.url for r in replicas], work, keys).start()
        try:
            yield Servers(replicas, tenants, router)
        finally:
            router.stop()


def complete(url: str, prompt: str) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    reply = loopback.post(f"{url}/v1/completions", json=body, headers=ADMIN, timeout=60)
    assert reply.status_code == 200, reply.text


def tokens(url: str, prompt: str) -> list[int]:
    """The ids a completion of ``prompt`` prefills (the replica's own ``/tokenize``)."""
    reply = loopback.post(f"{url}/tokenize", json={"prompt": prompt}, headers=ADMIN, timeout=30)
    return reply.json()["tokens"]


def fork(prompts: list[list[int]]) -> tuple[int, int]:
    """The deepest full block more than one prompt extends, and by how many blocks."""
    chunks = [tuple(tuple(p[i : i + 4]) for i in range(0, len(p) // 4 * 4, 4)) for p in prompts]
    children: dict[tuple, set] = {}
    for chain in chunks:
        for depth in range(1, len(chain)):
            children.setdefault(chain[:depth], set()).add(chain[depth])
    deepest = max((len(k), len(v)) for k, v in children.items() if len(v) > 1)
    return deepest


def by_state(url: str) -> dict[str, int]:
    text = loopback.get(f"{url}/metrics", headers=ADMIN, timeout=10).text
    return {
        sample.labels["state"]: int(sample.value)
        for family in text_string_to_metric_families(text)
        if family.name == "prefixcache_kv_blocks_by_state"
        for sample in family.samples
    }


def run_top(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``prefixcache top ARGS`` off a terminal, without a key from this environment."""
    environment = {k: v for k, v in os.environ.items() if k != "PREFIXCACHE_API_KEY"}
    environment.update(env or {})
    command = [*TOP, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, env=environment)


def test_one_frame_shows_the_pool_as_metrics_say_and_prefixes_by_digest_only(servers):
    replica = servers.replicas[0]
    prompts = [f"{DOCUMENT} {question}" for question in QUESTIONS]
    for prompt in prompts:
        complete(replica.url, prompt)
    shown = run_top(replica.url, "--once", "--api-key", ADMIN_KEY)
    assert shown.returncode == 0, shown.stderr
    frame = shown.stdout
    states = by_state(replica.url)  # idle: the same numbers as when the frame was taken
    assert sum(states.values()) == 2048 and states["cached"] > 0
    for state, count in states.items():
        assert re.search(rf"^\s*\S {state}\s+{count:,}\s", frame, re.M), (state, frame)
    hit = re.search(r"^\s*([\d.]+)%\s+[\d.]+ s\s", frame, re.M)  # the hit-rate cell
    assert hit and float(hit.group(1)) > 0, frame
    # The first row is where the prompts part: the deepest block that more than one of them
    # extends, named by its digest, with as many branches as prompts part there.
    ids = [tokens(replica.url, prompt) for prompt in prompts]
    blocks, branches = fork(ids)
    health = loopback.get(f"{replica.url}/health").json()
    tenant = servers.tenants.authenticate(ADMIN["Authorization"])
    salt = servers.tenants.cache_salt(tenant, None)
    chain = prompt_digests(bytes.fromhex(health["namespace_digest"]), 4, ids[0], salt)
    first = re.search(r"longest shared prefixes *\n.*\n(.*)\n", frame)
    assert first, frame
    expected = [chain[blocks - 1].hex()[:12], str(blocks * 4), str(blocks), str(branches), "0"]
    assert first.group(1).split() == expected, frame
    assert "zebrafinch" not in frame and "Who?" not in frame  # never prompt text
    assert not re.search(r"\b\d+(, \d+){3,}", frame)  # nor a list of token ids


def test_a_key_file_needs_an_admin_key(servers):
    url = servers.replicas[0].url
    watch = f"watch it: prefixcache top {url} --api-key <an admin key>"
    assert watch in servers.replicas[0].log_path.read_text()  # what serve says at start-up
    without = run_top(url, "--once")
    assert without.returncode == 2 and without.stdout == ""
    assert without.stderr.count("\n") == 1 and "--api-key" in without.stderr, without.stderr
    assert "Traceback" not in without.stderr
    not_admin = run_top(url, "--once", "--api-key", "sk-beta")
    assert not_admin.returncode == 2 and "not an admin" in not_admin.stderr
    from_env = run_top(url, "--once", env={"PREFIXCACHE_API_KEY": ADMIN_KEY})
    assert from_env.returncode == 0 and "longest shared prefixes" in from_env.stdout
    router = run_top(servers.router.url, "--once")
    assert router.returncode == 2 and "/admin/replicas needs an admin key" in router.stderr


def test_an_unreachable_url_is_one_line_and_exit_2(servers):
    closed = ReplicaProcess(Path("unused"), Path("unused")).url  # a free port, nobody on it
    shown = run_top(closed, "--once")
    assert shown.returncode == 2 and shown.stderr.count("\n") == 1, shown.stderr
    assert "cannot reach a prefixcache server" in shown.stderr


class Tmux:
    """A detached tmux session on a socket of its own, 160 x 48, running one command that
    writes its exit status and the terminal's settings before and after to ``folder``."""

    def __init__(self, folder: Path) -> None:
        if shutil.which("tmux") is None:
            pytest.fail("tmux is not installed: `prefixcache top` is tested in a real terminal")
        self.folder = folder
        self.socket = f"prefixcache-top-{os.getpid()}-{time.monotonic_ns()}"

    def start(self, argv: list[str]) -> None:
        f = self.folder
        script = (
            f"stty -g > {f / 'before'}; {shlex.join(argv)} 2> {f / 'stderr'}; "
            f"echo $? > {f / 'status.part'}; stty -g > {f / 'after.part'}; "
            f"mv {f / 'after.part'} {f / 'after'}; mv {f / 'status.part'} {f / 'status'}; "
            "sleep 60"  # each file whole once it exists: a test reads it at once
        )
        self.tmux("new-session", "-d", "-x", "160", "-y", "48", script)

    def tmux(self, *args: str) -> str:
        done = subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return done.stdout

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p")

    def wait_for(self, pattern: str, timeout: float = 30.0) -> str:
        """Until the screen matches ``pattern``; that screen."""
        shown: list[str] = []

        def matches() -> bool:
            shown[:] = [self.screen()]
            return re.search(pattern, shown[0], re.M) is not None

        try:
            wait_until(matches, timeout, pattern)
        except AssertionError:
            raise AssertionError(f"no {pattern!r} on the screen:\n{shown[0]}") from None
        return shown[0]

    def status(self, timeout: float = 5.0) -> str:
        """The command's exit status, once it exited."""
        path = self.folder / "status"  # moved in after "after": both are whole then
        wait_until(path.exists, timeout, "the view to exit")
        return path.read_text().strip()

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True)


@pytest.fixture
def tmux(tmp_path: Path) -> Iterator[Tmux]:
    terminal = Tmux(tmp_path)
    try:
        yield terminal
    finally:
        terminal.close()


def clock(screen: str) -> str:
    found = re.search(r"\d\d:\d\d:\d\d", screen)
    assert found, screen
    return found.group(0)


def test_the_live_view_refreshes_and_quits_on_q(servers, tmux):
    url = servers.replicas[0].url
    tmux.start([*TOP, url, "--api-key", ADMIN_KEY, "--interval", "0.5"])
    # the frame's last part too: a capture may catch tmux mid-way through a redraw
    first = tmux.wait_for(r"^ · free\s+[\d,]+ [\s\S]*longest shared prefixes")
    assert "prefixcache top" in first
    tmux.wait_for(rf"prefixcache top .* (?!{clock(first)})\d\d:\d\d:\d\d")  # redrawn
    complete(url, f"{DOCUMENT} {QUESTIONS[0]}")  # a hit within the window: a rate, not "-"
    tmux.wait_for(r"cache and queue \(last \d+ s\)[\s\S]*^\s*[\d.]+%\s")
    pressed = time.monotonic()
    tmux.tmux("send-keys", "q")
    assert tmux.status() == "0"
    assert time.monotonic() - pressed < 3.0
    assert (tmux.folder / "before").read_text() == (tmux.folder / "after").read_text()
    assert (tmux.folder / "stderr").read_text() == ""
    assert "pool:" not in tmux.screen()  # the alternate screen is gone


def row(number: int, replica: ReplicaProcess, state: str) -> str:
    """A pattern for one replica's row in the router view."""
    return rf"^\s*{number}\s+127\.0\.0\.1:{replica.port}\s+{state}\s"


def test_the_router_view_shows_a_replica_down_and_back_and_quits_on_ctrl_c(servers, tmux):
    first, victim = servers.replicas
    tmux.start([*TOP, servers.router.url, "--api-key", ADMIN_KEY, "--interval", "0.5"])
    tmux.wait_for(row(1, victim, "up"))
    victim.kill()
    try:
        shown = tmux.wait_for(row(1, victim, "down"), 15)
        assert re.search(row(0, first, "up"), shown, re.M), shown
    finally:
        victim.start()
        victim.wait_ready()
    tmux.wait_for(row(1, victim, "up"), 30)
    assert not (tmux.folder / "status").exists()  # the view ran on throughout
    tmux.tmux("send-keys", "C-c")  # Ctrl-C quits as cleanly as q
    assert tmux.status() == "0"
    assert (tmux.folder / "before").read_text() == (tmux.folder / "after").read_text()
    assert (tmux.folder / "stderr").read_text() == ""
