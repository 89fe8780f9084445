"""The hit-rate plot: one line per policy and one for the optimum (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path

from prefixcache.sim.sweep import SweepReport


def plot_hit_rates(report: SweepReport, path: str | Path) -> None:
    """Block hit rate vs capacity to a PNG; needs matplotlib (``pip install matplotlib``)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(7, 4.5))
    for label, capacities, rates, style in _lines(report):
        axes.plot(capacities, rates, style, label=label)
    limit = report.trace["infinite_block_hit_rate"] * 100
    axes.axhline(limit, color="grey", linewidth=0.8, linestyle=":", label="unbounded cache")
    axes.set_xlabel("capacity (blocks)")
    axes.set_ylabel("block hit rate (%)")
    axes.set_title(f"{Path(report.trace['path']).name}: hit rate vs capacity")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    pyplot.close(figure)


def _lines(report: SweepReport) -> list[tuple[str, list[int], list[float], str]]:
    """(label, capacities, hit rates in %, style): each policy, then the optimum."""
    index = report.results[0].index
    lines = []
    for policy in dict.fromkeys(run.policy for run in report.results):
        runs = sorted(
            (run for run in report.results if run.policy == policy and run.index == index),
            key=lambda run: run.capacity,
        )
        lines.append(
            (policy, [r.capacity for r in runs], [100 * r.block_hit_rate for r in runs], "o-")
        )
    optimum = sorted(report.optimum, key=lambda item: item.capacity)
    if optimum:
        rates = [100 * item.block_hit_rate for item in optimum]
        lines.append(("optimum (Belady)", [item.capacity for item in optimum], rates, "k--"))
    return lines
