"""ConServe's Fig. 8 ablation as a plot, from the points a paper-scale run saved (no simulation):

    python -m experiments.conserve_fig8 OUT.png POINTS.jsonl [POINTS.jsonl ...]

Each points file is one seed's (`python -m experiments conserve --points FILE`). Fig. 8 (§6.4.1)
adds ConServe's mechanisms one at a time on Fig. 7's load at CV 1 and 2 req/s: vLLM++, then the
preemptive SLO-aware scheduler alone (preempting by vLLM's swapping), then incremental
checkpointing, then background prefetching (= ConServe). The plot has two panels, each bar over
vLLM++'s on the same seed: offline processed throughput (higher is better) and online P99 TTFT
(lower is better). Ours is the mean over the files with the range as error bars; the paper's
bars come from §6.4.1's numbers: 3,674 tok/s for vLLM++, 2,951 for the scheduler alone, +14.0%
for checkpointing and +13.6% for prefetching (3,818 tok/s); P99 TTFT 1,346 ms for vLLM++, 446 ms
for the scheduler alone and 316 ms for ConServe (the text gives none for checkpointing alone).
"""
from __future__ import annotations

from pathlib import Path

from experiments.conserve import CONSERVE, FIG8_CV, FIG78, SCHED_ONLY, VLLMPP, WITH_CKPT, run_label
from experiments.points import read_points
from experiments.report import mean_and_range, points_plot_main, save_figure

BARS = (VLLMPP, SCHED_ONLY, WITH_CKPT, CONSERVE)
SHORT = {VLLMPP: "vLLM++", SCHED_ONLY: "scheduler only\n(swap)", WITH_CKPT: "+ checkpointing",
         CONSERVE: "+ prefetch\n(ConServe)"}
# §6.4.1's numbers over vLLM++'s: offline tok/s and P99 TTFT (None: the paper gives none).
PAPER_THROUGHPUT = {VLLMPP: 1.0, SCHED_ONLY: 2951 / 3674, WITH_CKPT: 2951 * 1.140 / 3674, CONSERVE: 3818 / 3674}
PAPER_TTFT = {VLLMPP: 1.0, SCHED_ONLY: 446 / 1346, WITH_CKPT: None, CONSERVE: 316 / 1346}
METRICS = (("offline_processed_tok_s", "offline processed tok/s vs vLLM++", PAPER_THROUGHPUT),
           ("online_ttft_p99", "online P99 TTFT vs vLLM++", PAPER_TTFT))


def fig8_over_vllmpp(points: Path) -> dict[str, dict[str, float]]:
    """Each Fig. 8 system's offline processed tok/s and online P99 TTFT over vLLM++'s, from one
    seed's points: {metric: {system: ratio}}."""
    rows: dict[str, dict] = {}
    runs = {run_label(system, FIG78, FIG8_CV): system for system in BARS}
    for key, row in read_points(points).items():
        run = key.split("|")[1]
        if run in runs:
            rows[runs[run]] = row
    missing = [s for s in BARS if s not in rows]
    if missing:
        raise ValueError(f"{points}: no Fig. 8 point of {', '.join(missing)}")
    return {metric: {s: rows[s][metric] / rows[VLLMPP][metric] for s in BARS} for metric, _, _ in METRICS}


def plot(points: list[Path], out: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = [fig8_over_vllmpp(p) for p in points]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    x = range(len(BARS))
    for ax, (metric, label, paper) in zip(axes, METRICS):
        ours = [[seed[metric][s] for seed in seeds] for s in BARS]
        means, spread = mean_and_range(ours)
        ax.bar([i - 0.2 for i in x], means, 0.4, yerr=spread, capsize=3, label=f"ours (seeds: {len(seeds)}, range)")
        paper_bars = [(i + 0.2, paper[s]) for i, s in zip(x, BARS) if paper[s] is not None]
        ax.bar([i for i, _ in paper_bars], [v for _, v in paper_bars], 0.4, label="paper (§6.4.1)")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(list(x), [SHORT[s] for s in BARS], fontsize=8)
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle("ConServe Fig. 8 ablation: CV 1, 2 req/s, each bar over vLLM++ on the same seed", fontsize=9)
    return save_figure(fig, out)


if __name__ == "__main__":
    points_plot_main(__doc__, plot)
