"""BROS's §4.2 ablation as a plot, from the points a run saved (no simulation):

    python -m experiments.bros_ablation OUT.png POINTS.jsonl [POINTS.jsonl ...]

Each points file is one seed's (`python -m experiments bros --points FILE`). Every "§4.2 ..."
variant run at Fig. 10(a)'s top rate is shown as its RT normalized latency over the default
BROS's (B0 = 8, x2) in the same file: the mean over the files, the range as error bars. The
paper gives no numbers to set beside them (the section's symbols were lost), so the plot shows
ours alone.
"""
from __future__ import annotations

from pathlib import Path

from experiments.points import read_points
from experiments.report import mean_and_range, points_plot_main, save_figure

DEFAULT = "§4.2 B0=8, x2"  # BROS's defaults, run again under the ablation's label


def latency_ratios(points: Path) -> dict[str, float]:
    """Each §4.2 variant's RT normalized latency over the default's, from one seed's points."""
    latency: dict[str, float] = {}
    for key, row in read_points(points).items():
        parts = key.split("|")
        if len(parts) > 5 and parts[5].startswith("§4.2 "):
            latency[parts[5]] = row["rt_norm_latency"]
    if DEFAULT not in latency:
        raise ValueError(f"{points}: no '{DEFAULT}' point (run the experiment's ablation first)")
    return {label: value / latency[DEFAULT] for label, value in latency.items() if label != DEFAULT}


def plot(points: list[Path], out: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [latency_ratios(p) for p in points]
    variants = [v for v in runs[0] if all(v in run for run in runs)]
    values = [[run[v] for run in runs] for v in variants]
    means, spread = mean_and_range(values)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.barh([v.removeprefix("§4.2 ") for v in variants], means, xerr=spread, capsize=3)
    ax.axvline(1, color="black", linewidth=0.8)
    ax.set_xlabel(f"RT normalized latency / the default's (B0 = 8, x2); {len(runs)} seeds, range")
    ax.set_title("BROS §4.2 ablation at capacity (Fig. 10(a)'s top rate)", fontsize=9)
    ax.invert_yaxis()
    return save_figure(fig, out)


if __name__ == "__main__":
    points_plot_main(__doc__, plot)
