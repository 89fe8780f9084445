"""The replicas behind the router: health checks, load scraping, joining and leaving.

A replica is in the rotation while its ``/health`` answers and its namespace (model,
block size, namespace digest) agrees with the cluster's: the first replica to answer
sets it, and one that disagrees is refused with a log line saying why. A replica that
fails a check or refuses a connection leaves the rotation and its index entries are
dropped; when it answers again it rejoins with a fresh event feed (replay from seq 0).

A replica whose ``/health`` says its KV events are down stays in the rotation (it still
serves) but is routed as if it held nothing: its feed stops and its index entries go, so
no stale cache knowledge is trusted. Once its events are ok again it gets a fresh feed.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import NamedTuple
from urllib.parse import urlsplit

import httpx

from prefixcache.protocol.response_ids import is_instance
from prefixcache.router.feed import EventEndpoints, EventFeed
from prefixcache.router.index import GlobalIndex
from prefixcache.router.membership import Member, MembershipFile

log = logging.getLogger("prefixcache.router")

DEFAULT_HEALTH_INTERVAL_S = 1.0
DEFAULT_HEALTH_TIMEOUT_S = 3.0
LOAD_GAUGES = ("prefixcache_requests_running", "prefixcache_requests_waiting")
PENDING_PREFILL_GAUGE = "prefixcache_prefill_tokens_pending"
# A replica's pending prompt tokens count in its load as requests: 512 tokens, about half a
# second of prefill on 2 cores, weigh as one more request in flight (docs/router-and-cluster.md).
PREFILL_TOKENS_PER_REQUEST = 512.0
WILDCARD_HOSTS = ("0.0.0.0", "*", "::", "[::]")


class ClusterNamespace(NamedTuple):
    """What every replica must agree on for their digests to be comparable."""

    model: str
    block_size: int
    root: bytes  # the namespace digest: root of every chain


class ReplicaIdentity(NamedTuple):
    """A replica's ``/health``, parsed."""

    model: str
    block_size: int
    root: bytes
    tier: str | None
    events: EventEndpoints | None
    events_up: bool = True  # False: its publisher is down, so its events are not to be trusted
    instance: str | None = None  # its response ids' prefix (``protocol/response_ids.py``)

    @property
    def namespace(self) -> ClusterNamespace:
        return ClusterNamespace(self.model, self.block_size, self.root)


def parse_health(body: object, base_url: str) -> ReplicaIdentity:
    """``/health`` of a replica; ValueError if it is not one of ours (or not ok)."""
    if not isinstance(body, dict) or body.get("status") != "ok":
        raise ValueError("health status is not ok")
    try:
        events = body.get("kv_events")
        endpoints = None
        if events:
            endpoints = EventEndpoints(
                reachable(events["endpoint"], base_url),
                reachable(events["replay"], base_url) if events.get("replay") else None,
                str(events["topic"]),
            )
        return ReplicaIdentity(
            str(body["model"]),
            int(body["block_size"]),
            bytes.fromhex(body["namespace_digest"]),
            body.get("tier"),
            endpoints,
            events_up(events),
            body["instance"] if is_instance(body.get("instance")) else None,
        )
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"not a prefixcache replica's /health ({error!r})") from None


def events_up(events: object) -> bool:
    """Whether a ``/health``'s ``kv_events`` says they are published (no status: an older
    replica, up; anything but ``"ok"``: down)."""
    if not isinstance(events, dict):
        return True  # no events at all: nothing to distrust
    return events.get("status", "ok") == "ok"


def reachable(endpoint: str, base_url: str) -> str:
    """An event endpoint bound to a wildcard address, with the replica's own host instead."""
    scheme, _, rest = endpoint.partition("://")
    host, _, port = rest.rpartition(":")
    if host not in WILDCARD_HOSTS:
        return endpoint
    return f"{scheme}://{urlsplit(base_url).hostname}:{port}"


def parse_load(text: str) -> float:
    """Running plus waiting branches, from a replica's Prometheus text."""
    return parse_gauges(text, LOAD_GAUGES)


def parse_pending_prefill(text: str) -> float:
    """Prompt tokens the replica has still to compute (0 from one that does not say)."""
    return parse_gauges(text, (PENDING_PREFILL_GAUGE,))


def parse_gauges(text: str, names: tuple[str, ...]) -> float:
    """The sum of the unlabelled samples of ``names`` in Prometheus text."""
    total = 0.0
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            total += float(value)
    return total


@dataclass(slots=True, eq=False)
class Replica:
    """One replica as the router tracks it."""

    url: str
    healthy: bool = False
    identity: ReplicaIdentity | None = None
    in_flight: int = 0  # requests this router has open on it
    external_load: float = 0.0  # running + waiting it reported, less our in-flight then
    pending_prefill: float = 0.0  # prompt tokens it reported still to compute (ours too)
    refused: str | None = None  # why it is kept out despite answering
    last_error: str | None = None
    load_error: str | None = "not read yet"  # why its /metrics could not be read, last time
    feed: EventFeed | None = None
    headers: dict[str, str] = field(default_factory=dict)  # added to its responses

    @property
    def load(self) -> float:
        """Requests running or waiting there, ours (exact, now) plus others' (scraped), and
        its pending prompt tokens as requests (``PREFILL_TOKENS_PER_REQUEST``)."""
        return (
            self.in_flight + self.external_load + self.pending_prefill / PREFILL_TOKENS_PER_REQUEST
        )


class Fleet:
    """Every configured replica, and which of them are in the rotation."""

    def __init__(
        self,
        urls: list[str],
        index: GlobalIndex,
        client: httpx.AsyncClient,
        *,
        health_timeout_s: float = DEFAULT_HEALTH_TIMEOUT_S,
        use_events: bool = True,
        metrics_headers: dict[str, str] | None = None,
        membership: MembershipFile | None = None,
    ) -> None:
        self.replicas = {url: Replica(url) for url in dict.fromkeys(u.rstrip("/") for u in urls)}
        self.membership = membership  # a file whose list replaces ``urls`` when it changes
        self.index, self.client = index, client
        self.health_timeout_s = health_timeout_s
        self.use_events = use_events
        self.metrics_headers = metrics_headers or {}  # a replica's /metrics needs an admin key
        self.namespace: ClusterNamespace | None = None

    def healthy(self) -> list[Replica]:
        """The replicas in the rotation, in configured order."""
        return [r for r in self.replicas.values() if r.healthy]

    def by_instance(self, instance: str | None) -> Replica | None:
        """The healthy replica whose ``/health`` gave this instance id, if any."""
        if instance is None:
            return None
        found = (r for r in self.healthy() if r.identity and r.identity.instance == instance)
        return next(found, None)

    def unavailable_reason(self) -> str:
        """Why no replica can take a request, for a client's 503 (counts, never URLs)."""
        total, refused = len(self.replicas), sum(1 for r in self.replicas.values() if r.refused)
        counts = f"{len(self.healthy())} of {total} healthy"
        if refused:
            counts += f", {refused} refused for another model or block size"
        if self.namespace is None:
            return f"no replica is ready yet ({counts}; replicas are loading the model)"
        return f"no replica is healthy ({counts}; they stopped answering health checks)"

    def apply_members(self, members: list[Member]) -> None:
        """The replica set becomes ``members``: new ones join at their next check, those
        gone leave the rotation now (a request already on one finishes or fails alone)."""
        wanted = {m.url: m for m in members}
        for url in [url for url in self.replicas if url not in wanted]:
            self._drop(self.replicas.pop(url))
            log.info("replica %s left the replica list", url)
        for url, member in wanted.items():
            replica = self.replicas.setdefault(url, Replica(url))
            replica.headers = member.headers

    async def check_all(self) -> None:
        """Every replica's health fetched concurrently, applied in configured order.

        The order makes the first configured replica that answers the one whose namespace
        the cluster adopts, whichever answered first. A changed replicas file is read first.
        """
        members = self.membership.read_if_changed() if self.membership else None
        if members is not None:
            self.apply_members(members)
        replicas = list(self.replicas.values())
        probes = await asyncio.gather(*(self._probe(r) for r in replicas))
        for replica, probe in zip(replicas, probes, strict=True):
            self._apply(replica, probe)
        await asyncio.gather(*(self._scrape(r) for r in replicas if r.healthy))

    async def run(self, interval_s: float) -> None:
        """Check every ``interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            await self.check_all()

    async def check(self, replica: Replica) -> None:
        """One replica now (after a failed request): health, namespace, then load."""
        self._apply(replica, await self._probe(replica))
        if replica.healthy:
            await self._scrape(replica)

    async def _probe(self, replica: Replica) -> ReplicaIdentity | str:
        """Its ``/health`` parsed, or why it failed."""
        try:
            response = await self.client.get(f"{replica.url}/health", timeout=self.health_timeout_s)
            response.raise_for_status()
            return parse_health(response.json(), replica.url)
        except (httpx.HTTPError, ValueError) as error:
            return describe(error)

    def _apply(self, replica: Replica, probe: ReplicaIdentity | str) -> None:
        """Join, stay, leave or be refused, from one probe."""
        if isinstance(probe, str):
            self.mark_down(replica, probe)
            return
        problem = self._namespace_problem(probe)
        if problem is not None:
            self._refuse(replica, problem)
            return
        self._mark_up(replica, probe)

    def mark_down(self, replica: Replica, reason: str) -> None:
        """Out of the rotation; its index entries are dropped (it resyncs when back)."""
        first_failure = replica.healthy or replica.last_error is None
        replica.last_error = reason
        if first_failure:  # one line per outage, not one per check
            verb = "left the rotation" if replica.healthy else "is not available"
            log.warning("replica %s %s: %s", replica.url, verb, reason)
        self._drop(replica)

    def close(self) -> None:
        """Stop every feed (at shutdown)."""
        for replica in self.replicas.values():
            if replica.feed is not None:
                replica.feed.stop(join_s=1.0)
                replica.feed = None

    # -- internals --

    def _namespace_problem(self, identity: ReplicaIdentity) -> str | None:
        """Why this replica's digests would not match the cluster's (None: they would)."""
        if self.namespace is None:
            self.namespace = identity.namespace
            log.info(
                "cluster namespace: model %r, block size %d, digest %s",
                identity.model,
                identity.block_size,
                identity.root.hex()[:16],
            )
            return None
        if identity.namespace == self.namespace:
            return None
        return (
            f"its namespace (model {identity.model!r}, block size {identity.block_size}, digest "
            f"{identity.root.hex()[:16]}) differs from the cluster's (model "
            f"{self.namespace.model!r}, block size {self.namespace.block_size}, digest "
            f"{self.namespace.root.hex()[:16]}): another model, revision, dtype or block size"
        )

    def _refuse(self, replica: Replica, problem: str) -> None:
        if replica.refused != problem:
            log.error("replica %s refused: %s", replica.url, problem)
        replica.refused = replica.last_error = problem
        self._drop(replica)

    def _mark_up(self, replica: Replica, identity: ReplicaIdentity) -> None:
        """Into the rotation; a new or restarted replica gets a fresh feed (replay from 0)."""
        if replica.healthy and not self._needs_resync(replica, identity):
            replica.identity = identity
            return
        was_healthy = replica.healthy
        self._drop(replica)
        replica.identity, replica.refused, replica.last_error = identity, None, None
        if self.use_events and identity.events is not None:
            if identity.events_up:  # down: left unattached, no entries and no expectations
                replica.feed = EventFeed(
                    replica.url, identity.events, self.index, identity.tier
                ).start()
        else:
            self.index.attach(replica.url, identity.tier)  # no events: only expectations
        replica.healthy = True
        log.info(
            "replica %s %s (%s)",
            replica.url,
            "resynced (restarted, or its events changed)" if was_healthy else "joined the rotation",
            _events_note(identity),
        )

    def _needs_resync(self, replica: Replica, identity: ReplicaIdentity) -> bool:
        """A new epoch the feed has not seen yet (an idle restarted replica), a dead feed, or
        events that went down or came back up."""
        if replica.identity is None or replica.identity.tier != identity.tier:
            return True
        feed, events = replica.feed, identity.events
        if not self.use_events or (feed is None and events is None):
            return False
        if events is not None and not identity.events_up:
            return feed is not None or replica.identity.events_up  # events just went down
        if feed is None or events is None or not feed.alive:
            return True
        same_sockets = (feed.events.endpoint, feed.events.replay) == (
            events.endpoint,
            events.replay,
        )
        return not same_sockets or feed.topic != events.topic.encode()

    def _drop(self, replica: Replica) -> None:
        replica.healthy = False
        if replica.feed is not None:
            replica.feed.stop()
            replica.feed = None
        self.index.detach(replica.url)

    async def _scrape(self, replica: Replica) -> None:
        """The replica's running + waiting, minus what of it is ours (counted exactly)."""
        ours = replica.in_flight
        try:
            response = await self.client.get(
                f"{replica.url}/metrics",
                headers=self.metrics_headers,
                timeout=self.health_timeout_s,
            )
            response.raise_for_status()
            replica.external_load = max(0.0, parse_load(response.text) - ours)
            replica.pending_prefill = parse_pending_prefill(response.text)
            replica.load_error = None
        except (httpx.HTTPError, ValueError) as error:
            replica.load_error = describe(error)  # load stays as last seen; health decides


def _events_note(identity: ReplicaIdentity) -> str:
    """How the router learns what a replica holds, for its join line."""
    if identity.events is None:
        return "no KV events"
    if not identity.events_up:
        return "KV events down: routed as if it held nothing until they are ok"
    return "KV events " + identity.events.topic


def describe(error: Exception) -> str:
    """A short reason for a log line (never a request body)."""
    if isinstance(error, httpx.HTTPStatusError):
        return f"HTTP {error.response.status_code}"
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
