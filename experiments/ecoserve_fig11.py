"""EcoServe's Fig. 11 ablation as a plot, from the points a run saved (no simulation):

    python -m experiments.ecoserve_fig11 OUT.png POINTS.jsonl [POINTS.jsonl ...] [--rate 2.0]

Each points file is one seed's (`python -m experiments ecoserve --points FILE`). For every
variant of `ABLATION` (EcoServe-D, -SD, -SDO, EcoServe) the plot shows its mean JCT against
vLLM (2023)'s at the same rate, under the flat per-step pricing, as a change in percent (lower
is better): ours as the mean over the files with the range as error bars, beside the paper's
(`PAPER_ABLATION`, §4 "Ablation Study", averaged over its traces and models).
"""
from __future__ import annotations

from pathlib import Path

from experiments.ecoserve import ABLATION, PAPER_ABLATION, VLLM_2023
from experiments.points import read_points
from experiments.report import mean_and_range, points_plot_parser, save_figure

VARIANTS = tuple(s.label for s in ABLATION if s.label in PAPER_ABLATION)


def jct_changes(points: Path, rate: float) -> dict[str, float]:
    """Each variant's mean JCT over vLLM (2023)'s, minus one, at `rate` (flat pricing)."""
    jct: dict[str, float] = {}
    for key, row in read_points(points).items():
        if key.endswith("|Fig. 11 flat") and row["rate"] == rate:
            jct[row["system"]] = row["jct_mean"]
    if VLLM_2023.label not in jct:
        raise ValueError(f"{points}: no Fig. 11 point of {VLLM_2023.label} at rate {rate}")
    return {v: jct[v] / jct[VLLM_2023.label] - 1 for v in VARIANTS if v in jct}


def plot(points: list[Path], rate: float, out: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [jct_changes(p, rate) for p in points]
    variants = [v for v in VARIANTS if all(v in run for run in runs)]
    ours = [[100 * run[v] for run in runs] for v in variants]
    means, spread = mean_and_range(ours)
    paper = [-100 * PAPER_ABLATION[v]["jct"] for v in variants]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = range(len(variants))
    ax.bar([i - 0.2 for i in x], means, 0.4, yerr=spread, capsize=3, label=f"ours (seeds: {len(runs)}, range)")
    ax.bar([i + 0.2 for i in x], paper, 0.4, label="paper (§4, mean over traces and models)")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks(list(x), variants)
    ax.set_ylabel(f"mean JCT vs {VLLM_2023.label} (%)")
    ax.set_title(f"EcoServe Fig. 11 ablation: JCT against vLLM (2023), {rate:g} req/s (ShareGPT units)", fontsize=9)
    ax.legend(fontsize=8)
    return save_figure(fig, out)


def main() -> None:
    parser = points_plot_parser(__doc__)
    parser.add_argument("--rate", type=float, default=2.0, help="the ablation rate (ShareGPT's units)")
    args = parser.parse_args()
    print(f"wrote {plot(args.points, args.rate, args.out)}")


if __name__ == "__main__":
    main()
