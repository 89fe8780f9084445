"""What the CLI hands each deployment through Ray (secrets included: never on a command line)."""

from __future__ import annotations

import socket
from dataclasses import dataclass

APP_NAME = "prefixcache"
ENGINE = "PrefixcacheEngine"
INGRESS = "PrefixcacheIngress"
HEARTBEAT_S = 2.0  # a replica tells the ingress it is alive this often
TIER_ENV = "PREFIXCACHE_KV_TIER"  # the child reads its tier spec (maybe a password) here


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """One replica's ``prefixcache serve``: its flags and the files it is given."""

    serve_flags: tuple[str, ...]  # e.g. --model, --kv-cache-bytes: nothing secret
    tenant_secret: bytes  # the secret file's contents, shared by every replica
    api_keys: bytes | None  # the key file's contents, if tenants have keys
    tier: str | None  # handed to the child in TIER_ENV
    threads: int
    ingress: str | None  # the deployment to register with; None under --routing ray


@dataclass(frozen=True, slots=True)
class IngressSpec:
    """The router in front: where it listens and its flags."""

    host: str
    port: int
    route_flags: tuple[str, ...]
    tenant_secret: bytes
    api_keys: bytes | None


def free_port(host: str) -> int:
    """A port on ``host`` that nobody listens on right now."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def address(host: str, port: int) -> str:
    """``host:port``, brackets around an IPv6 host."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def base_url(host: str, port: int) -> str:
    return f"http://{address(host, port)}"


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")
