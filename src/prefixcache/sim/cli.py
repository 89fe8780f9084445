"""``prefixcache simulate``: replay a trace, compare policies and indexes, bound them.

Wire it into the main parser with ``add_simulate_parser(subcommands)`` and dispatch
``args.command == "simulate"`` to ``run_simulate(args)``.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from prefixcache.argtypes import positive_int, unit_share
from prefixcache.cache.common import DEFAULT_BLOCK_SIZE
from prefixcache.cache.index import INDEX_NAMES
from prefixcache.cache.policies import POLICY_NAMES
from prefixcache.progress import progress_bar
from prefixcache.sim.kv_options import DEFAULT_CAPACITIES, add_kv_options
from prefixcache.sim.traces import TRACE_FORMATS

if TYPE_CHECKING:
    from prefixcache.sim.kv_model import KVModel
    from prefixcache.sim.sweep import SweepReport
    from prefixcache.sim.traces import Trace


def add_simulate_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``simulate`` subcommand and its options."""
    parser = subparsers.add_parser(
        "simulate",
        help="replay a trace through the real cache: hit rates per policy, and the optimum",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument(
        "trace", help="a trace: Mooncake or Bailian JSONL (hash_ids), ours (token_ids), or CSV"
    )
    _add_sweep_options(parser)
    parser.add_argument(
        "--recommend", action="store_true",
        help="replay every policy from a quarter to four times each --capacity and name the "
        "one never below LRU there and best at that capacity",
    )  # fmt: skip
    parser.add_argument("--no-optimum", action="store_true", help="skip Belady's bound")
    parser.add_argument("--out", help="write every result to a .json or .csv file")
    parser.add_argument("--plot", help="write hit rate vs capacity to a PNG")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_tenant_options(parser)
    _add_retention_options(parser)
    _add_cluster_options(parser)
    add_kv_options(parser)
    return parser


def _add_retention_options(parser: argparse.ArgumentParser) -> None:
    """Retention on a trace that has none: which TTL and budget pay."""
    parser.add_argument(
        "--retention-ttl", type=non_negative_seconds, nargs="+", default=[], metavar="SECONDS",
        help="also replay (first --policy) with every prompt retained SECONDS, each "
        "TTL x --retention-budget beside no retention: hit rates, saved hits, evictions, "
        "refusals (300 is OpenAI's in_memory, 86400 its 24h)",
    )  # fmt: skip
    parser.add_argument(
        "--retention-budget", type=unit_share, nargs="+", default=[0.5], metavar="SHARE",
        help="each tenant's share of the pool it may retain (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--retain-prefix-blocks", type=positive_int, nargs="+", metavar="N",
        help="mark only each prompt's first N blocks (Mooncake: ids), each N a row "
        "(default: the whole prompt)",
    )  # fmt: skip


def non_negative_seconds(text: str) -> float:
    """A finite number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{value} must be a finite number >= 0")
    return value


def _add_tenant_options(parser: argparse.ArgumentParser) -> None:
    """Tenants: split a trace into K of them; replay it through a fair pool too."""
    parser.add_argument(
        "--tenants", type=positive_int, metavar="K",
        help="split the trace into K tenants by a hash of each request's first block "
        "(replaces its tenant fields)",
    )  # fmt: skip
    parser.add_argument(
        "--cache-share", type=share_arg, nargs="+", default=[], metavar="TENANT=SHARE",
        help="cache shares for the fair replay (the rest split equally; default: all equal)",
    )  # fmt: skip
    parser.add_argument(
        "--no-fairness", action="store_true",
        help="with 2+ tenants, skip the fair-pool replay and its per-tenant table",
    )  # fmt: skip


def share_arg(text: str) -> tuple[str, float]:
    """``TENANT=SHARE``, the share a number (checked with the others when the pool is built)."""
    name, _, share = text.rpartition("=")
    try:
        return name, float(share)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TENANT=SHARE, got {text!r}") from None


def _add_cluster_options(parser: argparse.ArgumentParser) -> None:
    """A cluster: N caches of the first --capacity each, behind the router's policies."""
    from prefixcache.sim.cluster import CLUSTER_POLICY_NAMES as ROUTING_NAMES

    parser.add_argument(
        "--replicas", type=positive_int, help="simulate a cluster of N replicas instead"
    )
    parser.add_argument(
        "--routing", nargs="+", choices=ROUTING_NAMES, default=list(ROUTING_NAMES),
        help="routing policies for --replicas (default: all); key-affinity is cache-aware "
        "keeping each cache_key on one replica, as the router does with prompt_cache_key",
    )  # fmt: skip
    parser.add_argument(
        "--shared-tier", type=positive_int, default=0, metavar="BLOCKS",
        help="a KV tier of BLOCKS shared by every replica",
    )  # fmt: skip
    parser.add_argument("--replicas-plot", help="write hit rate vs 1..N replicas to a PNG")


def _add_sweep_options(parser: argparse.ArgumentParser) -> None:
    """What to replay: capacities, policies, indexes, trace format and block size."""
    parser.add_argument(
        "--capacity", type=positive_int, nargs="+",
        help=f"pool sizes in blocks every layer holds (default: {DEFAULT_CAPACITIES})",
    )  # fmt: skip
    parser.add_argument(
        "--policy", nargs="+", choices=POLICY_NAMES, default=list(POLICY_NAMES),
        help="eviction policies (default: all)",
    )  # fmt: skip
    parser.add_argument(
        "--index", nargs="+", choices=INDEX_NAMES, default=["hash"],
        help="prefix index(es); several: compare their replay wall time (default: hash)",
    )  # fmt: skip
    parser.add_argument(
        "--trace-format", "--format", dest="trace_format", choices=TRACE_FORMATS, default="auto",
        help="the trace's format (default: %(default)s, from its first line)",
    )  # fmt: skip
    parser.add_argument(
        "--block-size", type=positive_int, default=DEFAULT_BLOCK_SIZE,
        help="tokens per block of token-id and CSV traces (default: %(default)s; Mooncake "
        "blocks are 512 tokens, Bailian's 16)",
    )  # fmt: skip


def run_simulate(args: argparse.Namespace) -> int:
    """Run the sweep, print the tables, write the requested files; the exit status.

    Bad input (a malformed trace, a capacity below the largest request, an --out that is
    neither .json nor .csv) prints one line to stderr and returns 2.
    """
    try:
        return _simulate(args)
    except ValueError as error:
        print(f"prefixcache simulate: error: {error}", file=sys.stderr)
        return 2


def _simulate(args: argparse.Namespace) -> int:
    from prefixcache.sim import report as reporting
    from prefixcache.sim.kv_options import capacities_of, kv_model_of
    from prefixcache.sim.recommend import format_recommendations, sweep_plan
    from prefixcache.sim.replay import block_tokens, check_windows
    from prefixcache.sim.sweep import run_sweep
    from prefixcache.sim.traces import load_trace, split_tenants

    if args.out and not args.out.endswith((".json", ".csv")):
        raise ValueError(f"--out {args.out}: the suffix must be .json or .csv")
    kv = kv_model_of(args)
    trace = load_trace(args.trace, args.trace_format, args.block_size)
    if args.tenants:
        trace = split_tenants(trace, args.tenants, args.block_size)
    args.capacity = capacities_of(args, kv, block_tokens(trace, args.block_size))
    check_windows(trace, kv)
    _check_capacity(trace, args)
    if args.replicas:
        if kv is not None and kv.windowed:
            raise ValueError(
                "--replicas replays all-full caches: drop --window (or --kv-layout full)"
            )
        from prefixcache.sim.cluster_report import run_cluster_simulation

        return run_cluster_simulation(trace, args)
    capacities, policies = sweep_plan(trace, args)
    total = len(trace.requests) * len(capacities) * len(policies) * len(args.index)
    with progress_bar(total, "replay", "req", args.quiet) as progress:
        report = run_sweep(
            trace,
            capacities,
            policies,
            list(dict.fromkeys(args.index)),
            block_size=args.block_size,
            optimum=not args.no_optimum,
            progress=progress,
            kv=kv,
        )
    print(reporting.format_report(report))
    if kv is not None:
        print(reporting.format_layout(report, kv))
    if args.recommend:
        print(format_recommendations(report, args.capacity, args.index[0]))
    _fairness(trace, report, args, kv)
    _retention(trace, report, args, kv)
    _write_outputs(report, args)
    return 0 if reporting.same_hits(report) else 1


def _check_capacity(trace: Trace, args: argparse.Namespace) -> None:
    """ValueError unless every prompt fits the smallest capacity (naming its bytes if given)."""
    from prefixcache.sim.replay import check_capacity

    try:
        check_capacity(trace, min(args.capacity), args.block_size)
    except ValueError as error:
        if not args.kv_cache_bytes:
            raise
        budget = min(args.kv_cache_bytes)
        raise ValueError(
            f"{error}: --kv-cache-bytes {budget:,} holds {min(args.capacity)} blocks of every layer"
        ) from None


def _fairness(
    trace: Trace, report: SweepReport, args: argparse.Namespace, kv: KVModel | None
) -> None:
    """With 2+ tenants: each --capacity and policy through a fair pool; the per-tenant table."""
    from prefixcache.cache.owners import check_shares
    from prefixcache.sim.fairness import format_fairness, run_fairness, tenants_of

    tenants = tenants_of(trace)
    shares = check_shares(dict(args.cache_share))
    unknown = sorted(set(shares) - set(tenants))
    if unknown:
        raise ValueError(f"--cache-share names {unknown}, not tenants of the trace {tenants}")
    if len(tenants) < 2 or args.no_fairness:
        return
    shared = report.restricted(list(args.capacity))
    total = len(trace.requests) * len(shared.results)
    with progress_bar(total, "replay", "req", args.quiet) as progress:
        rows = run_fairness(
            trace, shared, shares, block_size=args.block_size, progress=progress, kv=kv
        )
    print(format_fairness(rows, tenants, shares))
    report.fairness = [row.as_dict() for row in rows]


def _retention(
    trace: Trace, report: SweepReport, args: argparse.Namespace, kv: KVModel | None
) -> None:
    """With --retention-ttl: each --capacity x TTL x budget, and the retention table."""
    from prefixcache.sim import report as reporting
    from prefixcache.sim.sweep import run_retention_sweep

    if not args.retention_ttl:
        return
    prefixes = args.retain_prefix_blocks or [None]
    runs = 1 + len(args.retention_ttl) * len(args.retention_budget) * len(prefixes)
    total = len(trace.requests) * len(set(args.capacity)) * runs
    with progress_bar(total, "replay", "req", args.quiet) as progress:
        report.retention = run_retention_sweep(
            trace,
            list(args.capacity),
            args.policy[0],
            list(args.retention_ttl),
            list(args.retention_budget),
            prefixes,
            block_size=args.block_size,
            progress=progress,
            kv=kv,
        )
    print(reporting.format_retention(report.retention))


def _write_outputs(report: SweepReport, args: argparse.Namespace) -> None:
    """The --out file and the --plot PNG, if asked for."""
    from prefixcache.sim import report as reporting

    if args.out:
        reporting.write_report(report, args.out)
        print(f"results: {args.out}")
    if args.plot:
        from prefixcache.sim.plots import plot_hit_rates

        plot_hit_rates(report, args.plot)
        print(f"plot: {args.plot}")
