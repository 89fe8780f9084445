"""Sweep output: the terminal table, JSON and CSV."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from prefixcache.sim.kv_model import KVModel
from prefixcache.sim.replay import ReplayResult
from prefixcache.sim.sweep import SweepReport

CSV_FIELDS = [
    "capacity",
    "policy",
    "index",
    "block_hit_rate",
    "token_hit_rate",
    "hit_blocks",
    "blocks",
    "hit_tokens",
    "tokens",
    "evictions",
    "peak_usage",
    "peak_cached_blocks",
    "wall_seconds",
    "layout",
    "pages",
    "kv_bytes",
    "kv_cache_dtype",
    "window_pages_released",
    "window_pages_evicted",
    "window_lost_tokens",
    "kv_bytes_per_cached_token",
]


def _columns(report: SweepReport) -> tuple[list[int], list[str], str]:
    """Capacities, policies (in run order) and the index whose results fill the tables."""
    capacities = sorted({run.capacity for run in report.results})
    policies = list(dict.fromkeys(run.policy for run in report.results))
    return capacities, policies, report.results[0].index


def format_table(report: SweepReport, metric: str = "block_hit_rate") -> str:
    """One row per capacity, one column per policy (percent), the optimum beside them."""
    capacities, policies, index = _columns(report)
    optimum = {item.capacity: item.block_hit_rate for item in report.optimum}
    show_optimum = bool(optimum) and metric == "block_hit_rate"
    header = ["capacity", *policies] + (["optimum"] if show_optimum else [])
    rows = [" ".join(f"{name:>9}" for name in header)]
    for capacity in capacities:
        cells = [f"{capacity:>9}"]
        for policy in policies:
            value = getattr(report.result(capacity, policy, index), metric)
            cells.append(f"{100 * value:>9.2f}")
        if show_optimum:
            cells.append(f"{100 * optimum[capacity]:>9.2f}")
        rows.append(" ".join(cells))
    return "\n".join(rows)


def format_timings(report: SweepReport) -> str:
    """Replay wall time per index and policy (summed over capacities); identical hits?"""
    capacities, policies, _ = _columns(report)
    indexes = list(dict.fromkeys(run.index for run in report.results))
    lines = []
    for index in indexes:
        parts = []
        for policy in policies:
            seconds = sum(report.result(c, policy, index).wall_seconds for c in capacities)
            parts.append(f"{policy} {seconds:.2f}s")
        lines.append(f"  index {index}: " + ", ".join(parts))
    if len(indexes) > 1:
        lines.append("  identical hits across indexes: " + ("yes" if same_hits(report) else "NO"))
    return "\n".join(lines)


def same_hits(report: SweepReport) -> bool:
    """Whether every index served exactly the same blocks to every request."""
    first: dict[tuple[int, str], list[int]] = {}
    for run in report.results:
        expected = first.setdefault((run.capacity, run.policy), run.hits_per_request)
        if run.hits_per_request != expected:
            return False
    return True


def format_report(report: SweepReport) -> str:
    """Everything the terminal shows."""
    trace = report.trace
    lines = [
        f"trace {trace['path']} ({trace['format']}): {trace['requests']:,} requests, "
        f"{trace['block_references']:,} block references, {trace['distinct_blocks']:,} "
        f"distinct; unbounded cache {100 * trace['infinite_block_hit_rate']:.2f}%",
        f"block hit rate (%), index {report.results[0].index}:",
        format_table(report),
        "token hit rate (%):",
        format_table(report, "token_hit_rate"),
        "replay wall time:",
        format_timings(report),
    ]
    return "\n".join(lines)


def format_layout(report: SweepReport, kv: KVModel) -> str:
    """Per capacity and policy (first index): pool, token hit rate, window counters and KV
    bytes per cached token (all groups, the full group, the window groups together)."""
    header = (
        f"{'capacity':>9} {'pages':>8} {'KV MiB':>8} {'policy':>8} {'token %':>8} "
        f"{'released':>9} {'evicted':>9} {'lost tok':>9} {'B/token':>9} {'full':>8} {'windows':>8}"
    )
    lines = [f"{kv.describe()}; bytes per cached token after the trace:", header]
    index = report.results[0].index
    for run in (run for run in report.results if run.index == index):
        per_group = run.bytes_per_cached_token
        windows = sum(value for group, value in per_group.items() if group != "full")
        sizes = (
            run.kv_bytes / 2**20,
            run.kv_bytes_per_cached_token,
            per_group.get("full", 0),
            windows,
        )
        mib, total, full, windows = (f"{v:,.1f}" if per_group else "-" for v in sizes)
        lines.append(
            f"{run.capacity:>9} {run.pages:>8} {mib:>8} {run.policy:>8} "
            f"{100 * run.token_hit_rate:>8.2f} {run.window_pages_released:>9} "
            f"{run.window_pages_evicted:>9} {run.window_lost_tokens:>9} {total:>9} {full:>8} "
            f"{windows:>8}"
        )
    return "\n".join(lines)


def format_retention(runs: list[ReplayResult]) -> str:
    """One row per capacity x TTL x budget: hit rates, hits retention saved, its costs."""
    header = (
        f"{'capacity':>9} {'ttl s':>8} {'budget':>6} {'prefix':>6} {'block %':>8} {'token %':>8} "
        f"{'saved':>8} {'evicted':>8} {'refused':>8} {'expired':>8}"
    )
    lines = [f"retention (prefix: blocks marked per prompt; policy {runs[0].policy}):", header]
    for run in runs:
        ttl = "none" if not run.retention_ttl else f"{run.retention_ttl:g}"
        budget = "-" if not run.retention_ttl else f"{run.retention_budget:g}"
        prefix = run.retention_prefix_blocks
        prefix = "-" if not run.retention_ttl else "all" if prefix is None else str(prefix)
        lines.append(
            f"{run.capacity:>9} {ttl:>8} {budget:>6} {prefix:>6} {100 * run.block_hit_rate:>8.2f} "
            f"{100 * run.token_hit_rate:>8.2f} {run.retention_saved_hits:>8} "
            f"{run.retention_evictions:>8} {run.retention_refused:>8} {run.retention_expired:>8}"
        )
    return "\n".join(lines)


def as_json(report: SweepReport) -> dict:
    """The whole report as plain data."""
    return {
        "trace": report.trace,
        "results": [run.as_dict() for run in report.results],
        "optimum": [
            {
                "capacity": item.capacity,
                "hit_blocks": item.hit_blocks,
                "block_hit_rate": item.block_hit_rate,
                "wall_seconds": item.wall_seconds,
            }
            for item in report.optimum
        ],
        **({"fairness": report.fairness} if report.fairness else {}),
        **({"retention": [run.as_dict() for run in report.retention]} if report.retention else {}),
    }


def write_report(report: SweepReport, path: str | Path) -> None:
    """JSON or CSV, by the file's suffix; ValueError for anything else."""
    path = Path(path)
    if path.suffix == ".json":
        path.write_text(json.dumps(as_json(report), indent=2) + "\n", encoding="utf-8")
    elif path.suffix == ".csv":
        _write_csv(report, path)
    else:
        raise ValueError(f"--out {path}: the suffix must be .json or .csv")


def _write_csv(report: SweepReport, path: Path) -> None:
    """One row per replay, then one per optimum (policy "optimum", blocks only)."""
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for run in report.results:
            writer.writerow(run.as_dict())
        for item in report.optimum:
            writer.writerow(
                {
                    "capacity": item.capacity,
                    "policy": "optimum",
                    "block_hit_rate": item.block_hit_rate,
                    "hit_blocks": item.hit_blocks,
                    "wall_seconds": item.wall_seconds,
                }
            )
