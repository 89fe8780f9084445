"""`simulate --replicas N --routing ...`: the cluster table and the hit rate vs replicas plot."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from prefixcache.sim.cluster import ClusterResult, simulate_cluster
from prefixcache.sim.traces import Trace


def cluster_table(results: Sequence[ClusterResult]) -> list[str]:
    """One line per policy: cluster hit rate, the ideal (one big cache), imbalance."""
    first = results[0]
    lines = [
        f"cluster: {first.replicas} replicas x {first.capacity} blocks "
        f"(ideal: one cache of {first.replicas * first.capacity} blocks)",
        f"{'routing':>14}  {'hit %':>7}  {'pool %':>7}  {'tier %':>7}  {'ideal %':>7}  "
        f"{'of ideal':>8}  {'imbalance':>9}  requests per replica",
    ]
    for r in results:
        pool = 100 * r.hit_blocks / r.blocks if r.blocks else 0.0
        tier = 100 * r.tier_blocks / r.blocks if r.blocks else 0.0
        share = r.hit_rate / r.ideal_hit_rate if r.ideal_hit_rate else 1.0
        lines.append(
            f"{r.policy:>14}  {100 * r.hit_rate:7.2f}  {pool:7.2f}  {tier:7.2f}  "
            f"{100 * r.ideal_hit_rate:7.2f}  {share:8.3f}  {r.imbalance:9.2f}  {r.per_replica}"
        )
    return lines


def sweep_replicas(
    trace: Trace,
    max_replicas: int,
    capacity: int,
    policies: Sequence[str],
    **options: object,
) -> dict[str, list[ClusterResult]]:
    """Each policy at 1..max_replicas replicas of ``capacity`` blocks each."""
    return {
        policy: [
            simulate_cluster(trace, n, capacity, policy, **options)
            for n in range(1, max_replicas + 1)
        ]
        for policy in policies
    }


def plot_replicas(sweep: dict[str, list[ClusterResult]], path: str | Path, title: str) -> None:
    """Hit rate vs replicas per policy, and the ideal single cache, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.2))
    for policy, results in sweep.items():
        counts = [r.replicas for r in results]
        axes.plot(counts, [100 * r.hit_rate for r in results], marker="o", label=policy)
    ideal = next(iter(sweep.values()))
    axes.plot(
        [r.replicas for r in ideal],
        [100 * r.ideal_hit_rate for r in ideal],
        linestyle="--",
        color="black",
        label="one cache of N x capacity",
    )
    axes.set_xlabel("replicas")
    axes.set_ylabel("block hit rate (%)")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def run_cluster_simulation(trace: Trace, args) -> int:
    """`simulate --replicas N`: the table at N replicas, and the plot over 1..N if asked."""
    policies = list(dict.fromkeys(args.routing))
    capacity = args.capacity[0]
    options = {"shared_tier": args.shared_tier, "block_size": args.block_size}
    if args.replicas_plot:
        sweep = sweep_replicas(trace, args.replicas, capacity, policies, **options)
        results = [runs[-1] for runs in sweep.values()]
        plot_replicas(sweep, args.replicas_plot, f"{Path(trace.path).name}, {capacity} blocks each")
    else:
        results = [simulate_cluster(trace, args.replicas, capacity, p, **options) for p in policies]
    print("\n".join(cluster_table(results)))
    if args.replicas_plot:
        print(f"plot: {args.replicas_plot}")
    return 0
