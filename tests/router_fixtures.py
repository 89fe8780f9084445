"""Real replicas (``prefixcache serve`` subprocesses on the tiny model) and an in-thread router."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import uvicorn
from safetensors.torch import save_file

import loopback
from child_process import terminate
from engine_fixtures import random_state_dict, tiny_config
from prefixcache.engine.model_files import load_tokenizer
from prefixcache.protocol.auth import Tenants
from prefixcache.protocol.front import uvicorn_config
from prefixcache.protocol.tenant_secret import load_or_create_secret
from prefixcache.router.app import RouterConfig, RouterState, create_router_app
from server_fixtures import free_port, write_key_file

START_TIMEOUT_S = 60.0


def write_tiny_hf_model(folder: Path) -> Path:
    """The tiny random Llama of ``engine_fixtures`` as a Hugging Face folder (default tokenizer)."""
    tokenizer = load_tokenizer()
    config = tiny_config(tokenizer.vocab_size, tokenizer.eos_token_ids)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(random_state_dict(config), str(folder / "model.safetensors"))
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    specials = {**tokenizer.special_tokens, "chat_template": tokenizer.chat_template}
    (folder / "tokenizer_config.json").write_text(json.dumps(specials))
    hf_config = {
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": True,
        "eos_token_id": list(config.eos_token_ids),
        "_name_or_path": config.name,
    }
    (folder / "config.json").write_text(json.dumps(hf_config))
    return folder


@dataclass
class ReplicaProcess:
    """``python -m prefixcache.cli serve`` on fixed loopback ports (so a restart reuses them)."""

    model: Path
    workdir: Path
    extra_args: tuple[str, ...] = ()
    port: int = field(default_factory=free_port)
    events_port: int = field(default_factory=free_port)
    replay_port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"replica-{self.port}.log"

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "prefixcache.cli", "serve",
            "--model", str(self.model), "--served-model-name", "tiny",
            "--port", str(self.port), "--block-size", "4", "--kv-cache-blocks", "2048",
            "--kv-events", f"tcp://127.0.0.1:{self.events_port}",
            "--kv-events-replay", f"tcp://127.0.0.1:{self.replay_port}",
            *self.extra_args,
        ]  # fmt: skip

    def start(self) -> ReplicaProcess:
        """Launch without waiting (start several, then ``wait_ready`` each)."""
        self.starts += 1
        log = self.log_path.open("a")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.process = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
        )
        log.close()
        return self

    def wait_ready(self) -> dict:
        """Until ``/health`` answers; its body."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"replica exited: {self.log_tail()}")
            try:
                return loopback.get(f"{self.url}/health", timeout=1).json()
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError(f"replica did not start: {self.log_tail()}")

    def pause(self) -> None:
        """SIGSTOP: frozen where it is; what it had sent still reaches its peers."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def kill(self) -> None:
        """SIGKILL: no shutdown, no goodbye on the sockets."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        terminate(self.process)

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text().splitlines()[-lines:])


@contextmanager
def serving(app, read_timeout: float | None = None) -> Iterator[str]:
    """Serve any ASGI ``app`` on a free loopback port in a thread; yield its base URL. With
    ``read_timeout``, uvicorn is set up as ``prefixcache route`` sets it up (the front's)."""
    port = free_port()
    options: dict = {"log_level": "warning", "lifespan": "on"}
    if read_timeout is None:
        config = uvicorn.Config(app, host="127.0.0.1", port=port, **options)
    else:
        config = uvicorn_config(app, "127.0.0.1", port, read_timeout, **options)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@contextmanager
def running_router(config: RouterConfig) -> Iterator[tuple[str, RouterState]]:
    """A router on a free loopback port in a thread; yield (base URL, its state)."""
    app = create_router_app(config)
    with serving(app, config.limits.request_read_timeout) as url:
        yield url, app.state.router


def metric_total(state: RouterState, name: str) -> float:
    """The sum of one metric's samples over all labels (e.g. retries by reason)."""
    return sum(
        sample.value
        for family in state.metrics.registry.collect()
        for sample in family.samples
        if sample.name == name
    )


def wait_until(predicate, timeout: float = 15.0, what: str = "condition") -> None:
    """Poll ``predicate`` every 20 ms until true; AssertionError naming ``what`` otherwise."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@contextmanager
def tiny_replicas(
    work: Path, count: int = 2
) -> Iterator[tuple[list[ReplicaProcess], Tenants, Path]]:
    """``count`` tiny-model replicas sharing one key file and tenant secret, each ready; the
    tenants as the router reads them, and the model folder."""
    model = write_tiny_hf_model(work / "tiny")
    keys, secret = write_key_file(work), work / "tenant-secret"
    tenants = Tenants.from_file(keys, load_or_create_secret(secret))
    shared = ("--api-key-file", str(keys), "--tenant-secret-file", str(secret))
    replicas = [ReplicaProcess(model, work, shared).start() for _ in range(count)]
    try:
        for replica in replicas:
            replica.wait_ready()
        yield replicas, tenants, model
    finally:
        for replica in replicas:
            replica.stop()
