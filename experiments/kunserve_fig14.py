"""KunServe's Fig. 14 ablation as a plot, from the tables a run saved (no simulation):

    python -m experiments.kunserve_fig14 OUT.png TABLE.txt [TABLE.txt ...]

Each table is one seed's Fig. 14 report (the Markdown table `experiments.kunserve.fig14`
prints, saved as `benchmarks/results/kunserve/fig14-longbench-seedS.txt`): one row per variant,
each adding one mechanism to the one before. The plot draws, per seed, each variant's P99 TTFT
(left, log scale) and, for the variants that run pipelines, the bubble ratio (right), beside
the paper's bubble ratios (§5.3: 21.9% without the lookahead, 8.3% with it). A seed whose
cluster never throttled (no drop) shows flat bars: the mechanisms have nothing to do there.
"""
from __future__ import annotations

from pathlib import Path

from experiments.report import points_plot_main, save_figure

PAPER_BUBBLES = {"token-count micro-batches": 0.219, "lookahead": 0.083}  # §5.3, Fig. 14's text


def read_table(path: Path) -> list[dict[str, str]]:
    """The rows of the first Markdown table in `path`, as {column: cell}."""
    lines = [line for line in path.read_text().splitlines() if line.startswith("|")]
    if len(lines) < 3:
        raise ValueError(f"{path}: no Markdown table")
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    return [dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")))) for line in lines[2:]]


def _short(variant: str) -> str:
    return variant.split(" (")[0].removeprefix("+ ")


def plot(tables: list[Path], out: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [read_table(t) for t in tables]
    variants = [_short(row["variant"]) for row in runs[0]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    width = 0.8 / len(runs)
    for k, (table, rows) in enumerate(zip(tables, runs)):
        offsets = [i - 0.4 + width * (k + 0.5) for i in range(len(rows))]
        color = f"C{k}"  # one colour per seed in both panels (a seed without drops has no bubbles)
        left.bar(offsets, [float(row["ttft_p99"]) for row in rows], width, label=table.stem, color=color)
        bubbles = [(i, float(row["bubble_ratio"])) for i, row in zip(offsets, rows) if row["bubble_ratio"] != "None"]
        if bubbles:
            right.bar([i for i, _ in bubbles], [100 * b for _, b in bubbles], width, label=table.stem, color=color)
    for name, value in PAPER_BUBBLES.items():
        right.axhline(100 * value, linestyle="--", color="grey")
        right.annotate(f"paper, {name}: {100 * value:.1f}%", (0, 100 * value), fontsize=7, va="bottom")
    for ax in (left, right):
        ax.set_xticks(range(len(variants)), variants, rotation=20, ha="right", fontsize=7)
        ax.legend(fontsize=7)
    left.set(yscale="log", ylabel="P99 TTFT (s)", title="KunServe Fig. 14 (LongBench): P99 TTFT")
    right.set(ylabel="bubble ratio (%)", title="pipeline bubble ratio (variants that drop)")
    return save_figure(fig, out)


if __name__ == "__main__":
    points_plot_main(__doc__, plot)
