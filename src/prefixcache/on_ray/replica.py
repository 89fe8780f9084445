"""The engine deployment: each Ray Serve replica supervises one ``prefixcache serve``.

The replica picks a port on its node, starts the server there (events on two more ports),
and tells the ingress every few seconds that it is alive and where. Ray's health check
fails when the server exits, and Ray replaces the replica. Under ``--routing ray`` the
replica is the ingress itself: Ray's proxy calls ``__call__`` and it relays to its server.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import httpx
import ray
from ray import serve
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import StreamingResponse

from prefixcache.on_ray.keeper import ChildKeeper, PrivateFolder, Supervisor, prefixcache_command
from prefixcache.on_ray.specs import HEARTBEAT_S, EngineSpec
from prefixcache.protocol import loopback_http
from prefixcache.protocol.auth import Tenants
from prefixcache.protocol.event_flags import is_loopback_endpoint
from prefixcache.router.cluster import TIER_ENV, address, free_port, router_url
from prefixcache.router.forward import REPLICA_HEADER, forward_headers, response_headers
from prefixcache.router.replicas import Replica, parse_load

log = logging.getLogger("ray.serve")

NODE_HEADER = "x-prefixcache-node"
RAY_REPLICA_HEADER = "x-prefixcache-ray-replica"
LOAD_METRIC = "engine_load"  # running + waiting requests, for the autoscaling policy
CHECK_TIMEOUT_S = 5.0


class EngineReplica(Supervisor):
    """A Ray Serve replica wrapping one ``prefixcache serve`` on its node."""

    def __init__(self, spec: EngineSpec) -> None:
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.node = ray.get_runtime_context().get_node_id()
        host = ray.util.get_node_ip_address()
        port = free_port(host)
        self.url = router_url(host, port)
        self.routed_as = Replica(self.url, headers=replica_headers(self.node, self.replica_id))
        self.folder = PrivateFolder("prefixcache-replica-")
        keys = self.folder.write("api-keys.json", spec.api_keys) if spec.api_keys else None
        command, env = self._command(spec, host, port, keys)
        self.metrics_headers = Tenants.from_file(keys).admin_headers() if keys else {}
        self.ingress = (
            serve.get_deployment_handle(spec.ingress, context.app_name) if spec.ingress else None
        )
        self._warned = False
        self.keeper = ChildKeeper(command, env, f"{self.url}/health", self._heartbeat, HEARTBEAT_S)
        self.keeper.wait_ready()
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))
        log.info(
            "prefixcache replica %s serving at %s on node %s", self.replica_id, self.url, self.node
        )

    def _command(
        self, spec: EngineSpec, host: str, port: int, keys: Path | None
    ) -> tuple[list[str], dict[str, str]]:
        secret = self.folder.write("tenant-secret", spec.tenant_secret)
        events = f"tcp://{address(host, free_port(host))}"
        arguments = ["serve", "--host", host, "--port", str(port), "--threads", str(spec.threads)]
        arguments += ["--tenant-secret-file", str(secret), "--kv-events", events]
        arguments += ["--kv-events-replay", f"tcp://{address(host, free_port(host))}"]
        if not is_loopback_endpoint(events):
            arguments.append("--kv-events-allow-remote")  # the router is on another machine
        if keys is not None:
            arguments += ["--api-key-file", str(keys)]
        env = {}
        if spec.tier:
            arguments += ["--kv-tier", f"env:{TIER_ENV}"]
            env[TIER_ENV] = spec.tier
        return prefixcache_command(*arguments, *spec.serve_flags), env

    def member(self) -> dict:
        """Where this replica serves, for the ingress (and tests: its process ids)."""
        process = self.keeper.process
        return {
            "replica": self.replica_id,
            "url": self.url,
            "node": self.node,
            "pid": os.getpid(),
            "server_pid": process.pid if process else None,
        }

    def _heartbeat(self) -> None:
        if self.ingress is None:
            return
        try:
            self.ingress.register.remote(self.member()).result(timeout_s=HEARTBEAT_S * 2)
            self._warned = False
        except Exception as error:
            if not self._warned:
                log.warning(
                    "prefixcache replica %s: ingress unreachable: %s",
                    self.replica_id,
                    type(error).__name__,
                )
                self._warned = True

    def check_health(self) -> None:
        """Ray's health check: the server runs and answers ``/health``."""
        code = self.keeper.exit_code()
        if code is not None:
            raise RuntimeError(f"prefixcache serve exited with {code}")
        loopback_http.get(f"{self.url}/health", timeout=CHECK_TIMEOUT_S).raise_for_status()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Requests running and waiting on the server, for ``autoscale.engine_load_policy``."""
        response = await self.client.get(f"{self.url}/metrics", headers=self.metrics_headers)
        response.raise_for_status()
        return {LOAD_METRIC: parse_load(response.text)}

    async def __call__(self, request: Request) -> StreamingResponse:
        """``--routing ray``: relay one HTTP request to the server, streamed back."""
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        upstream = await self.client.send(
            self.client.build_request(
                request.method,
                self.url + path,
                headers=forward_headers(request),
                content=await request.body(),
            ),
            stream=True,
        )
        headers = response_headers(upstream, self.routed_as, decoded=False)
        return StreamingResponse(
            upstream.aiter_raw(), status_code=upstream.status_code, headers=headers,
            background=BackgroundTask(upstream.aclose),
        )  # fmt: skip


def replica_headers(node: str, replica_id: str) -> dict[str, str]:
    """What every response of this replica carries besides ``x-prefixcache-replica``."""
    return {NODE_HEADER: node, RAY_REPLICA_HEADER: replica_id}


__all__ = ["LOAD_METRIC", "REPLICA_HEADER", "EngineReplica", "replica_headers"]
