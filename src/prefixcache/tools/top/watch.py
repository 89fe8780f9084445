"""What the view watches: one replica, or a router and every replica behind it. Each tick
scrapes them all (in parallel) into ``Frame``; a server that does not answer shows as down
and is asked again next tick, its window kept until it answers (a restart resets it)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from prefixcache.tools.top.numbers import ReplicaNumbers, replica_numbers
from prefixcache.tools.top.samples import Window
from prefixcache.tools.top.scrape import Client, Down, TopError

MAX_THREADS = 16


@dataclass(slots=True)
class ReplicaView:
    """One replica as last scraped: its numbers, where its cached chains fork and end (the
    longest shared prefixes), or why it is down."""

    url: str
    numbers: ReplicaNumbers | None = None
    prefixes: list[dict] = field(default_factory=list)
    model: str | None = None
    error: str | None = None  # None: it answered this tick

    @property
    def up(self) -> bool:
        return self.error is None


@dataclass(slots=True)
class RouterView:
    """The router: whether it answered, its policy, requests in flight, requests finished."""

    policy: str | None = None
    pending: int | None = None
    requests: float | None = None  # over its window
    seconds: float = 0.0
    error: str | None = None


@dataclass(slots=True)
class Frame:
    """Everything one screen shows."""

    url: str
    router: RouterView | None
    replicas: list[ReplicaView]
    wall: float  # time.time() of the scrape


class Watch:
    """The servers behind ``url`` and each one's window of scrapes."""

    def __init__(self, client: Client, url: str) -> None:
        self.client, self.url = client, url.rstrip("/")
        self.is_router = False
        self.windows: dict[str, Window] = {}
        self.router_window = Window()
        self.members: list[str] = []
        self.pool = ThreadPoolExecutor(MAX_THREADS, thread_name_prefix="top-scrape")

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def start(self) -> None:
        """The first look: ``TopError`` if the URL does not answer or refuses the key."""
        try:
            health = self.client.health(self.url)
            self.is_router = "replicas" in health and "policy" in health
            if self.is_router:
                self.members = self.client.replicas(self.url)
            else:
                self.client.metrics(self.url)
        except Down as error:
            raise TopError(f"cannot reach a prefixcache server at {self.url}: {error}") from None

    def tick(self) -> Frame:
        """Scrape every server once; never raises for one that is down or refuses."""
        router = self._router() if self.is_router else None
        urls = self.members if self.is_router else [self.url]
        for gone in self.windows.keys() - set(urls):  # left the router's list (ray scaled in)
            del self.windows[gone]
        views = list(self.pool.map(self._replica, urls))
        return Frame(self.url, router, views, time.time())

    def _router(self) -> RouterView:
        """The router's own numbers and its current replica list (kept if it is down)."""
        view = RouterView()
        try:
            view.policy = self.client.health(self.url).get("policy")
            self.members = self.client.replicas(self.url)
            self.router_window.add(self.client.metrics(self.url))
        except (Down, TopError) as error:
            view.error = str(error)
            return view
        latest = self.router_window.latest
        pending = latest.get("prefixcache_router_pending") if latest else None
        view.pending = None if pending is None else int(pending)
        view.requests = self.router_window.change("prefixcache_router_requests_total")
        view.seconds = self.router_window.seconds
        return view

    def _replica(self, url: str) -> ReplicaView:
        """One replica's scrape into its window; its error if it did not answer."""
        view = ReplicaView(url)
        window = self.windows.setdefault(url, Window())
        try:
            samples = self.client.metrics(url)
            view.prefixes = self.client.prefixes(url)
        except (Down, TopError) as error:
            view.error = str(error)
            view.numbers = replica_numbers(window)  # the last known, shown greyed
            return view
        window.add(samples)
        view.numbers = replica_numbers(window)
        models = samples.by_label("vllm:num_requests_running", "model_name")
        view.model = next(iter(models), None)
        return view
