"""Tenants and API keys; the cache salt that isolates a tenant is derived here.

A tenant's salt is an HMAC of its name under a server secret, so no client can name or
guess another tenant's salt. A client's own ``cache_salt`` only narrows sharing inside
its tenant: it is folded into the HMAC with the tenant's name, never used alone.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from prefixcache.cache.owners import check_shares
from prefixcache.cache.retention import check_share
from prefixcache.protocol.priority import MIN_PRIORITY, check_priority, request_priority
from prefixcache.protocol.tenant_secret import SECRET_BYTES

LOCAL_TENANT = "local"
KEY_FILE_FORMAT = (
    '{"tenants": [{"name", "keys": [...], "admin", "no_reuse", "min_hit_tokens", "zero_on_evict",'
    ' "tier", "cache_share", "retention_budget", "priority", "min_priority"}]}'
)
TENANT_FIELDS = (
    "name", "keys", "admin", "no_reuse", "min_hit_tokens", "zero_on_evict", "tier", "cache_share",
    "retention_budget", "priority", "min_priority",
)  # fmt: skip
MISSING_KEY = "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
RENAMED_FIELDS = {"min_shared_tokens": "min_hit_tokens", "sensitive": "zero_on_evict"}


class AuthError(Exception):
    """A missing or unknown API key (HTTP 401)."""


@dataclass(frozen=True, slots=True)
class Tenant:
    """Who a request belongs to, and what it may do."""

    name: str
    admin: bool = False
    no_reuse: bool = False  # never reuse any prefix, not even its own
    min_hit_tokens: int = 0  # a hit counts only if at least this many tokens are shared
    zero_on_evict: bool = False  # zero its KV blocks before their slots are reused
    tier: bool = True  # its blocks may be written to (and read from) the second KV tier
    cache_share: float | None = None  # its share of the cached pool (--fair-cache); None: equal
    retention_budget: float | None = None  # share of the pool it may retain; None: the default
    priority: int = 0  # its requests' priority when they name none (lower runs first)
    min_priority: int = MIN_PRIORITY  # the most urgent priority its requests may ask for

    def priority_of(self, asked: int | None) -> int:
        """The priority a request of this tenant runs at; ValueError if above its cap."""
        return request_priority(asked, self.priority, self.min_priority)

    @property
    def uses_tier(self) -> bool:
        """No-reuse blocks are never reusable, so they never go to the tier either."""
        return self.tier and not self.no_reuse


class Tenants:
    """API key -> tenant, and the salts that keep tenants' cached blocks apart."""

    def __init__(
        self,
        tenants: dict[str, Tenant] | None,
        secret: bytes | None = None,
        admin_key: str | None = None,
        previous_secret: bytes | None = None,
    ) -> None:
        self._by_key_digest = tenants  # None: a single local tenant, no keys
        self._secret = secret or os.urandom(SECRET_BYTES)
        self._previous_secret = previous_secret  # during a rotation: its salts are read only
        self._admin_key = admin_key  # one admin's key: what a router shows its replicas

    @property
    def local(self) -> bool:
        return self._by_key_digest is None

    @classmethod
    def from_file(
        cls, path: str | Path, secret: bytes | None = None, previous_secret: bytes | None = None
    ) -> Tenants:
        """Load a key file shaped like ``KEY_FILE_FORMAT`` (optional fields: false, 0)."""
        try:
            entries = json.loads(Path(path).read_text())["tenants"]
            tenants, admin_key = {}, None
            for entry in entries:
                tenant = _tenant(entry)
                for key in entry["keys"]:
                    tenants[_digest(key)] = tenant
                    admin_key = admin_key or (key if tenant.admin else None)
            _cache_shares(tenants.values())  # together at most 1
        except (OSError, ValueError, KeyError, TypeError) as error:
            message = f"API key file {path}: {error!r}; expected {KEY_FILE_FORMAT}"
            raise ValueError(message) from None
        return cls(tenants, secret, admin_key, previous_secret)

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant of a ``Bearer`` key; AuthError when it is missing or unknown."""
        if self._by_key_digest is None:
            return Tenant(LOCAL_TENANT, admin=True)
        if not authorization or not authorization.startswith("Bearer "):
            raise AuthError(MISSING_KEY)
        tenant = self._by_key_digest.get(_digest(authorization.removeprefix("Bearer ")))
        if tenant is None:
            raise AuthError("invalid API key")
        return tenant

    def admin_headers(self) -> dict[str, str]:
        """Headers that open admin routes (``/metrics``) on a replica with this key file."""
        return {"Authorization": f"Bearer {self._admin_key}"} if self._admin_key else {}

    def cache_shares(self) -> dict[str, float]:
        """Tenant name -> ``cache_share``, for the tenants that set one (``--fair-cache``)."""
        return {} if self._by_key_digest is None else _cache_shares(self._by_key_digest.values())

    def retention_budgets(self) -> dict[str, float]:
        """Tenant name -> ``retention_budget``, for the tenants that set one."""
        tenants = self._by_key_digest.values() if self._by_key_digest else ()
        return {t.name: t.retention_budget for t in tenants if t.retention_budget is not None}

    def cache_key_id(self, tenant: Tenant, key: str | None) -> str | None:
        """An opaque id of a tenant's ``prompt_cache_key`` (two tenants' equal keys differ)."""
        return None if key is None else _salt(self._secret, [tenant.name, "cache-key", key])

    def cache_salt(self, tenant: Tenant, client_salt: str | None) -> str:
        """The salt for a request: per tenant (and client salt); unique if no reuse."""
        if tenant.no_reuse:
            return _salt(self._secret, [tenant.name, "no-reuse", uuid.uuid4().hex])
        return _salt(self._secret, [tenant.name, client_salt or ""])

    def previous_cache_salt(self, tenant: Tenant, client_salt: str | None) -> str | None:
        """The same request's salt under the previous secret (a rotation), else None."""
        if self._previous_secret is None or tenant.no_reuse:
            return None
        return _salt(self._previous_secret, [tenant.name, client_salt or ""])


def _salt(secret: bytes, parts: list[str]) -> str:
    """HMAC of the parts under ``secret``; unambiguous: ("a", "bc") != ("ab", "c")."""
    return hmac.new(secret, json.dumps(parts).encode(), hashlib.sha256).hexdigest()


def _tenant(entry: dict) -> Tenant:
    """One tenant entry; an unknown field is an error (a misspelt setting must not vanish)."""
    unknown = sorted(set(entry) - set(TENANT_FIELDS))
    if unknown:
        hints = [
            f"{name} (now {RENAMED_FIELDS[name]})" for name in unknown if name in RENAMED_FIELDS
        ]
        raise ValueError(
            f"unknown tenant fields {unknown}{'; renamed: ' + ', '.join(hints) if hints else ''}"
        )
    return Tenant(
        name=str(entry["name"]),
        admin=bool(entry.get("admin", False)),
        no_reuse=bool(entry.get("no_reuse", False)),
        min_hit_tokens=_non_negative(entry.get("min_hit_tokens", 0)),
        zero_on_evict=bool(entry.get("zero_on_evict", False)),
        tier=bool(entry.get("tier", True)),
        cache_share=_share(entry),
        retention_budget=_retention_budget(entry),
        **_priorities(entry),
    )


def _priorities(entry: dict) -> dict[str, int]:
    """``priority`` (default 0) and ``min_priority``: integers in the limits, the default not
    below the cap; ValueError naming the tenant."""
    name = repr(str(entry["name"]))
    default = check_priority(entry.get("priority", 0), f"tenant {name}'s priority")
    floor = check_priority(entry.get("min_priority", MIN_PRIORITY), f"tenant {name}'s min_priority")
    if default < floor:
        raise ValueError(f"tenant {name}'s priority {default} is below its min_priority {floor}")
    return {"priority": default, "min_priority": floor}


def _share(entry: dict) -> float | None:
    """``cache_share``: absent (None) or a number in (0, 1]; ValueError naming the tenant."""
    value = entry.get("cache_share")
    if value is None:
        return None
    name = str(entry["name"])
    return check_shares({name: value})[name]


def _retention_budget(entry: dict) -> float | None:
    """``retention_budget``: absent (None) or a share in [0, 1]; ValueError naming the tenant."""
    value = entry.get("retention_budget")
    return None if value is None else check_share(repr(str(entry["name"])), value)


def _cache_shares(tenants: Iterable[Tenant]) -> dict[str, float]:
    """The shares the tenants set, checked together (at most 1 in all)."""
    return check_shares({t.name: t.cache_share for t in tenants if t.cache_share is not None})


def _non_negative(value: object) -> int:
    """An integer >= 0 (``min_hit_tokens``); ValueError otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"min_hit_tokens must be an integer >= 0, got {value!r}")
    return value


def _digest(key: str) -> str:
    """Keys are compared by digest, so lookup time says nothing about key prefixes."""
    return hashlib.sha256(key.encode()).hexdigest()
