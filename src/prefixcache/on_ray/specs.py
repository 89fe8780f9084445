"""What the CLI hands each deployment through Ray (secrets included: never on a command line)."""

from __future__ import annotations

from dataclasses import dataclass

APP_NAME = "prefixcache"
ENGINE = "PrefixcacheEngine"
INGRESS = "PrefixcacheIngress"
HEARTBEAT_S = 2.0  # a replica tells the ingress it is alive this often


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
