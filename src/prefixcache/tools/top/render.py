"""One screen of ``prefixcache top`` as rich renderables (numbers, digests, never text)."""

from __future__ import annotations

import time

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from prefixcache.tools.top.numbers import ReplicaNumbers, TenantRow, merge_tenants
from prefixcache.tools.top.watch import Frame, ReplicaView, RouterView

BAR_WIDTH = 40
MARKS = {"running": ("█", "red"), "cached": ("▓", "green"), "retained": ("▒", "yellow"),
         "free": ("·", "dim")}  # fmt: skip
DASH = "-"


def render(frame: Frame, interval: float) -> RenderableType:
    """The whole screen: a title, then the replica's panels or the router's table."""
    if frame.router is None:
        body = replica_screen(frame.replicas[0])
    else:
        body = router_screen(frame.router, frame.replicas)
    return Group(title(frame, interval), *body)


def title(frame: Frame, interval: float) -> Text:
    kind = "router" if frame.router is not None else "replica"
    model = next((r.model for r in frame.replicas if r.model), None)
    clock = time.strftime("%H:%M:%S", time.localtime(frame.wall))
    text = Text("prefixcache top ", style="bold")
    text.append(f"{frame.url}  {kind}" + (f" of {model}" if model else ""))
    text.append(f"  {clock}  every {interval:g} s  q quits", style="dim")
    return text


def window_label(seconds: float) -> str:
    return f"last {seconds:.0f} s" if seconds >= 1 else "since start"


# --------------------------------------------------------------------- one replica
def replica_screen(view: ReplicaView) -> list[RenderableType]:
    """The replica's pool, cache, queue and tier, its tenants and its deepest chains."""
    if view.numbers is None:
        return [Text(f"down: {view.error}", style="red")]
    n = view.numbers
    parts: list[RenderableType] = []
    if not view.up:
        parts.append(Text(f"down (last numbers shown): {view.error}", style="red"))
    parts += [pool_table(n), summary_table(n), tenant_table(n.tenants, n.seconds)]
    parts.append(prefix_table([(None, row) for row in view.prefixes]))
    return parts


def pool_table(n: ReplicaNumbers) -> Table:
    """The pool by state, with a bar drawn one mark per state."""
    table = Table(title=f"pool: {n.blocks} blocks", title_justify="left", box=None)
    for column in ("state", "blocks", "share", ""):
        table.add_column(column, justify="left" if column in ("state", "") else "right")
    for state, (mark, style) in MARKS.items():
        count = n.states.get(state, 0)
        share = count / n.blocks if n.blocks else 0.0
        meter = Text(bar(share, mark), style)
        table.add_row(f"{mark} {state}", f"{count:,}", f"{share:.1%}", meter)
    return table


def bar(share: float, mark: str) -> str:
    return mark * round(share * BAR_WIDTH)


def summary_table(n: ReplicaNumbers) -> Table:
    """Hit rate, time saved, churn, queue, step time and the tier, in one grid."""
    label = window_label(n.seconds)
    table = Table(title=f"cache and queue ({label})", title_justify="left", box=None)
    for column in ("hit rate", "prefill saved", "evictions", "running", "waiting", "in flight",
                   "step", "tier hits", "tier misses", "tier load"):  # fmt: skip
        table.add_column(column, justify="right")
    table.add_row(*summary_cells(n))
    return table


def summary_cells(n: ReplicaNumbers) -> list[str]:
    tier = n.tier
    return [
        hit_rate(n),
        f"{n.saved_seconds:.2f} s",
        churn(n),
        str(n.running),
        str(n.waiting),
        str(n.pending),
        step(n),
        DASH if tier is None else f"{tier.hits:,.0f}",
        DASH if tier is None else f"{tier.misses:,.0f}",
        DASH if tier is None or tier.load_ms is None else f"{tier.load_ms:.1f} ms",
    ]


def hit_rate(n: ReplicaNumbers) -> str:
    return DASH if n.hit_rate is None else f"{n.hit_rate:.1%}"


def churn(n: ReplicaNumbers) -> str:
    rate = n.evictions_per_s
    return f"{n.evictions:,.0f}" + ("" if rate is None else f" ({rate:.1f}/s)")


def step(n: ReplicaNumbers) -> str:
    if n.step_ms is None:
        return DASH
    target = "" if n.step_target_ms is None else f" / {n.step_target_ms:.0f}"
    return f"{n.step_ms:.1f}{target} ms"


def tenant_table(rows: list[TenantRow], seconds: float) -> Table:
    """Each tenant's cached blocks against its share, retained blocks, churn, requests."""
    table = Table(title="tenants", title_justify="left", box=None)
    evicted = f"evicted ({window_label(seconds)})"
    columns = ("tenant", "share", "cached / share", "retained", evicted, "requests")
    for column in columns:
        table.add_column(column, justify="left" if column == "tenant" else "right")
    for row in rows:
        table.add_row(
            row.name,
            DASH if row.share is None else f"{row.share:.0%}",
            DASH if row.cached is None else f"{row.cached:,} / {row.share_blocks:,}",
            f"{row.retained:,}",
            DASH if row.evicted is None else f"{row.evicted:,.0f}",
            f"{row.requests:,.0f}",
        )
    return table


def prefix_table(rows: list[tuple[int | None, dict]]) -> Table:
    """The longest shared prefixes: where cached chains fork (branches) or end, by digest."""
    table = Table(title="longest shared prefixes", title_justify="left", box=None)
    if any(replica is not None for replica, _ in rows):
        table.add_column("replica", justify="right")
    for column in ("digest", "tokens", "blocks", "branches", "held by"):
        table.add_column(column, justify="left" if column == "digest" else "right")
    for replica, row in rows:
        numbers = (row.get(name, 0) for name in ("tokens", "blocks", "branches", "holders"))
        cells = [str(row.get("digest", "?"))[:16], *(_count(n) for n in numbers)]
        table.add_row(*([] if replica is None else [str(replica)]), *cells)
    return table


# --------------------------------------------------------------------- a router
def router_screen(router: RouterView, replicas: list[ReplicaView]) -> list[RenderableType]:
    """The router's line, one row per replica, their tenants summed, their deepest chains."""
    parts: list[RenderableType] = [router_line(router, replicas), replica_table(replicas)]
    numbers = [r.numbers for r in replicas if r.up and r.numbers is not None]
    if numbers:
        parts.append(tenant_table(merge_tenants(numbers), numbers[0].seconds))
    merged = [(i, row) for i, r in enumerate(replicas) if r.up for row in r.prefixes]
    merged.sort(key=lambda entry: _shared_first(entry[1]))
    parts.append(prefix_table(merged[:8]))
    return parts


def _count(value: object) -> str:
    """A count as the server sent it ("?" if it is not one)."""
    return f"{value:,}" if isinstance(value, int) else "?"


def _shared_first(row: dict) -> tuple[bool, int]:
    """Replicas' rows merged: the shared ones first, deepest first within each."""
    number = {k: v if isinstance(v, int) else 0 for k, v in row.items()}
    shared = number.get("branches", 0) > 1 or number.get("holders", 0) > 1
    return not shared, -number.get("tokens", 0)


def router_line(router: RouterView, replicas: list[ReplicaView]) -> Text:
    if router.error is not None:
        return Text(f"router down: {router.error}", style="red")
    up = sum(1 for r in replicas if r.up)
    text = Text(f"policy {router.policy}  replicas up {up}/{len(replicas)}")
    if router.pending is not None:
        text.append(f"  in flight {router.pending}")
    requests = router.requests or 0.0
    text.append(f"  requests {requests:,.0f} ({window_label(router.seconds)})")
    return text


def replica_table(replicas: list[ReplicaView]) -> Table:
    """One row per replica: up or down, the pool by state, hit rate, queue, churn, tier."""
    table = Table(title="replicas", title_justify="left", box=None)
    table.add_column("#", justify="right", no_wrap=True)
    table.add_column("replica", no_wrap=True)
    table.add_column("state", no_wrap=True)
    for column in (POOL_HEADER, "hit rate", "saved", "waiting", "step", "evicted", "tier hit/miss",
                   "tier load"):  # fmt: skip
        table.add_column(column, justify="right", no_wrap=True)
    for number, view in enumerate(replicas):
        table.add_row(str(number), view.url.split("://", 1)[-1], *replica_cells(view))
    return table


POOL_HEADER = "running/cached/retained/free"


def replica_cells(view: ReplicaView) -> list[Text | str]:
    """A replica's row after its URL; dashes while it is down."""
    state = Text("up", style="green") if view.up else Text("down", style="bold red")
    n = view.numbers
    if n is None or not view.up:
        return [state, *[DASH] * 8]
    tier = n.tier
    return [
        state,
        "/".join(f"{n.states.get(s, 0)}" for s in MARKS),
        hit_rate(n),
        f"{n.saved_seconds:.2f} s",
        str(n.waiting),
        DASH if n.step_ms is None else f"{n.step_ms:.1f} ms",
        f"{n.evictions:,.0f}",
        DASH if tier is None else f"{tier.hits:,.0f}/{tier.misses:,.0f}",
        DASH if tier is None or tier.load_ms is None else f"{tier.load_ms:.1f} ms",
    ]
