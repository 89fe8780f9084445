"""The ingress deployment: one Ray Serve replica supervising ``prefixcache route``.

The router listens on the port the user asked for, on the head node, and reads the
replica list from a file this deployment rewrites: each engine replica registers every
few seconds, and one not heard from for ``EXPIRY_S`` leaves the list (the router has
taken it out of the rotation long before, at its first failed health check).
"""

from __future__ import annotations

import threading
import time

from ray.serve.handle import DeploymentHandle

from prefixcache.on_ray.keeper import ChildKeeper, PrivateFolder, Supervisor, prefixcache_command
from prefixcache.on_ray.replica import replica_headers
from prefixcache.on_ray.specs import HEARTBEAT_S, IngressSpec
from prefixcache.router.cluster import router_url
from prefixcache.router.membership import Member, write_members

EXPIRY_S = HEARTBEAT_S * 3
PRUNE_S = 1.0


class RouterIngress(Supervisor):
    """A Ray Serve replica wrapping our router, fed the live replica set."""

    def __init__(self, spec: IngressSpec, engine: DeploymentHandle) -> None:
        self.engine = engine  # binding it makes Serve deploy the engine in this app
        self.folder = PrivateFolder("prefixcache-ingress-")
        self.replicas_file = self.folder.path / "replicas.json"
        write_members(self.replicas_file, [])
        self.lock = threading.Lock()
        self.members: dict[str, tuple[dict, float]] = {}  # replica id: (its entry, last seen)
        self.keeper = ChildKeeper(
            self._command(spec),
            {},
            f"{router_url(spec.host, spec.port)}/health",
            self._prune,
            PRUNE_S,
        )
        self.keeper.wait_ready()

    def _command(self, spec: IngressSpec) -> list[str]:
        secret = self.folder.write("tenant-secret", spec.tenant_secret)
        arguments = ["route", "--host", spec.host, "--port", str(spec.port)]
        arguments += [
            "--replicas-file",
            str(self.replicas_file),
            "--tenant-secret-file",
            str(secret),
        ]
        if spec.api_keys is not None:
            arguments += ["--api-key-file", str(self.folder.write("api-keys.json", spec.api_keys))]
        return prefixcache_command(*arguments, *spec.route_flags)

    def register(self, member: dict) -> None:
        """An engine replica says it is alive (every ``HEARTBEAT_S``)."""
        with self.lock:
            known = member["replica"] in self.members
            self.members[member["replica"]] = (member, time.monotonic())
            if not known:
                self._write()

    def replicas(self) -> list[dict]:
        """The replicas in the list now (what the router routes over)."""
        with self.lock:
            return [member for member, _ in self.members.values()]

    def _prune(self) -> None:
        with self.lock:
            now = time.monotonic()
            gone = [r for r, (_, seen) in self.members.items() if now - seen > EXPIRY_S]
            for replica in gone:
                del self.members[replica]
            if gone:
                self._write()

    def _write(self) -> None:
        members = [
            Member(m["url"], replica_headers(m["node"], m["replica"]))
            for m, _ in sorted(self.members.values(), key=lambda entry: entry[0]["replica"])
        ]
        write_members(self.replicas_file, members)

    def check_health(self) -> None:
        """Ray's health check: the router process runs."""
        code = self.keeper.exit_code()
        if code is not None:
            raise RuntimeError(f"prefixcache route exited with {code}")
