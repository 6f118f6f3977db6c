"""How an `ExperimentResult` is shown: the text `examples/simulate.py` prints, its JSON file and
its plots. Every output carries the workload's label, which says the trace is synthetic.

The text has three parts: the per-run table (sim/metrics.py's columns, one row per run and
request class), the comparisons (our ratio next to the paper's claim, and whether we reach its
low end), and the experiment's notes. A rate sweep (`extra["sweep"]`, EcoServe and BROS) also
gets its own table and a latency-against-rate plot, as the papers draw it.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from experiments import Comparison, ExperimentResult
from nanoserve.sim.metrics import markdown_table, plot, slugify, summarize, to_json

COLUMNS = ("label", "class", "count", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "norm_latency_mean",
           "slo_attainment", "throughput_tok_s", "preemptions")


TABLES = ("sweep", "ablation", "policies")  # extra[...] lists of rows an experiment may add


def _verdict(c: Comparison) -> str:
    if not math.isfinite(c.ours):
        return "-"
    if c.reaches_paper:
        return "yes"
    return "direction only" if c.same_direction else "no"


def comparison_table(comparisons: list[Comparison]) -> str:
    lines = ["| comparison | ours | paper | the paper's number was measured against | reaches the paper's low end |",
             "|---|---|---|---|---|"]
    for c in comparisons:
        lines.append(f"| {c.metric} | {c.ours:.2f}x | {c.paper} | {c.baseline or '-'} | {_verdict(c)} |")
    return "\n".join(lines) + "\n"


def rows_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    # Nested columns (e.g. a run's KV counters, {} or None per row) stay in the JSON only.
    keys = [k for k in rows[0] if not any(isinstance(row.get(k), dict) for row in rows)]
    lines = ["| " + " | ".join(keys) + " |", "|" + "|".join("---" for _ in keys) + "|"]
    for row in rows:
        cells = [f"{v:.4g}" if isinstance(v, float) else str(v) for v in (row.get(k) for k in keys)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def seeds_table(results: dict[int, ExperimentResult]) -> str:
    """Each comparison over several seeds' runs of one experiment: every seed's ratio, their
    mean and range, and whether the mean reaches the paper's low end. A comparison is matched
    by its metric's name; one a seed lacks is shown for the seeds that have it."""
    seeds = sorted(results)
    by_metric: dict[str, dict[int, Comparison]] = {}
    for seed in seeds:
        for c in results[seed].comparisons:
            by_metric.setdefault(c.metric, {})[seed] = c
    header = " | ".join(f"seed {seed}" for seed in seeds)
    lines = [f"| comparison | {header} | mean | min-max | paper | reaches the paper's low end (mean) |",
             "|---|" + "---|" * (len(seeds) + 4)]
    for metric, per_seed in by_metric.items():
        ratios = [c.ours for c in per_seed.values()]
        mean = sum(ratios) / len(ratios)
        cells = " | ".join(f"{per_seed[seed].ours:.2f}x" if seed in per_seed else "-" for seed in seeds)
        first = next(iter(per_seed.values()))
        verdict = _verdict(Comparison(metric, mean, first.paper, first.paper_low, first.baseline))
        lines.append(f"| {metric} | {cells} | {mean:.2f}x | {min(ratios):.2f}-{max(ratios):.2f}x | {first.paper} "
                     f"| {verdict} |")
    return "\n".join(lines) + "\n"


def format_report(result: ExperimentResult) -> str:
    rows = [(label, s) for label, run in result.runs.items() for s in summarize(run).values()]
    parts = [f"## {result.name}: {result.title}", f"Workload: {result.workload}", ""]
    if rows:
        parts += [markdown_table(rows, COLUMNS)]
    for key in TABLES:
        if result.extra.get(key):
            parts += [f"{key.capitalize()}:", "", rows_table(result.extra[key])]
    parts += [comparison_table(result.comparisons)]
    parts += [f"- {note}" for note in result.notes]
    return "\n".join(parts).rstrip() + "\n"


def save_json(result: ExperimentResult, path: str | Path) -> dict[str, Any]:
    extra = {"experiment": result.name, "title": result.title, "notes": result.notes,
             "comparisons": [{"metric": c.metric, "ours": c.ours, "paper": c.paper, "paper_low": c.paper_low,
                              "baseline": c.baseline, "reaches_paper": c.reaches_paper} for c in result.comparisons],
             **result.extra}
    return to_json(result.runs, path, workload=result.workload, extra=extra)


def save_plots(result: ExperimentResult, directory: str | Path) -> list[Path]:
    # Files are named after the experiment; the setup and the workload go in every title.
    caption = f"{result.title}\n{result.workload}"
    paths = plot(result.runs, directory, result.name, caption) if result.runs else []
    sweep = result.extra.get("sweep")
    if sweep and "rate" in sweep[0]:
        paths.append(_sweep_plot(result, sweep, Path(directory)))
    if result.extra.get("timeline"):
        paths.append(_timeline_plot(result, result.extra["timeline"], Path(directory)))
    return paths


def replot(json_path: str | Path, directory: str | Path) -> list[Path]:
    """The experiment's own plots (a rate sweep, KunServe's Fig. 12 timeline) again, from the file
    `--json` wrote, without running it: `python -m experiments.report FILE.json DIR`. (Per-run
    plots need the runs' records, which the file keeps only as summaries.)"""
    data = json.loads(Path(json_path).read_text())
    extra = data["extra"]
    result = ExperimentResult(name=extra["experiment"], title=extra["title"], workload=data["workload_note"],
                              runs={}, comparisons=[], notes=extra.get("notes", []), extra=extra)
    Path(directory).mkdir(parents=True, exist_ok=True)
    return save_plots(result, directory)


def _timeline_plot(result: ExperimentResult, timeline: dict[str, dict[str, dict[str, list]]], directory: Path) -> Path:
    """KunServe's Fig. 12, first two columns: per dataset (a row), each run's KV demand against
    the capacity, and its mean TTFT per window of arrivals, over time."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(timeline), 2, figsize=(13, 3.6 * len(timeline)), squeeze=False)
    for (demand_ax, ttft_ax), (dataset, series) in zip(axes, timeline.items()):
        for label, points in series["kv_demand"].items():
            demand_ax.step([t for t, _ in points], [d * 100 for _, d in points], where="post", label=label,
                           linewidth=0.8)
        demand_ax.axhline(100, color="grey", linestyle="--", label="KV capacity")
        demand_ax.set(xlabel="time (s)", ylabel="KV demand (% of capacity)", title=f"{dataset}: KV demand")
        for label, points in series["ttft_mean"].items():
            ttft_ax.plot([t for t, _ in points], [v for _, v in points], marker=".", label=label)
        ttft_ax.set(xlabel="time (s)", ylabel="mean TTFT (s)", yscale="log", title=f"{dataset}: mean TTFT")
        demand_ax.legend(fontsize=6, framealpha=0.6)
        ttft_ax.legend(fontsize=6, framealpha=0.6)
    return _save_with_heading(fig, result, 160, directory / f"{slugify(result.name)}-timeline.png")


def _sweep_plot(result: ExperimentResult, rows: list[dict[str, Any]], directory: Path) -> Path:
    """Latency against rate, one line per system; one panel per dataset when the rows name one
    (EcoServe: extra["threshold_s_per_token"] is then {dataset: threshold})."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = next(k for k in ("norm_latency", "rt_norm_latency") if k in rows[0])
    panels = list(dict.fromkeys(row.get("dataset") for row in rows))
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 5), squeeze=False)
    thresholds = result.extra.get("threshold_s_per_token")
    for ax, panel in zip(axes[0], panels):
        panel_rows = [row for row in rows if row.get("dataset") == panel]
        for system in dict.fromkeys(row["system"] for row in panel_rows):
            points = sorted((row["rate"], row[metric]) for row in panel_rows if row["system"] == system)
            ax.plot([p[0] for p in points], [p[1] * 1e3 for p in points], marker="o", label=system)
        threshold = thresholds.get(panel) if isinstance(thresholds, dict) else thresholds
        if threshold:
            ax.axhline(threshold * 1e3, color="grey", linestyle="--", label="sustained-rate threshold")
        ax.set(xlabel="request rate (req/s)", ylabel="normalized latency (ms/token)", yscale="log")
        if panel is not None:
            ax.set_title(panel, fontsize=10)
        ax.legend(fontsize=7)
    path = directory / f"{slugify(result.name)}-sweep.png"
    return _save_with_heading(fig, result, 80 + 100 * (len(panels) - 1), path)


def _save_with_heading(fig: Any, result: ExperimentResult, width: int, path: Path) -> Path:
    """Title the figure with the experiment's name, setup (wrapped at `width`) and workload, save
    it to `path` and close it."""
    import matplotlib.pyplot as plt

    heading = textwrap.wrap(f"{result.name}: {result.title}", width) + textwrap.wrap(result.workload, width)
    fig.suptitle("\n".join(heading), fontsize=8)
    fig.tight_layout()
    # Room above the panels for the heading's lines (8 pt, in inches over the figure's height).
    fig.subplots_adjust(top=1 - (len(heading) * 8 * 1.4 / 72 + 0.35) / fig.get_figheight())
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def save_figure(fig: Any, out: Path) -> Path:
    """Lay out, save (creating its folder) and close a figure; returns where it went."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def points_plot_parser(doc: str | None) -> argparse.ArgumentParser:
    """The command line of a plot drawn from saved points files: OUT.png POINTS.jsonl..."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("points", type=Path, nargs="+", help="one seed's points file each (--points)")
    return parser


def points_plot_main(doc: str | None, draw: Callable[[list[Path], Path], Path]) -> None:
    """A plot module's command line, `OUT.png POINTS.jsonl...` (`points_plot_parser`): `draw`
    the points files into OUT.png."""
    args = points_plot_parser(doc).parse_args()
    print(f"wrote {draw(args.points, args.out)}")


def mean_and_range(values: list[list[float]]) -> tuple[list[float], list[list[float]]]:
    """Each list's mean, and the distances from it down to the list's min and up to its max:
    a bar's height and its error bar (matplotlib's `yerr`) over seeds."""
    means = [statistics.mean(v) for v in values]
    return means, [[m - min(v) for m, v in zip(means, values)], [max(v) - m for m, v in zip(means, values)]]


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 3:
        sys.exit("usage: python -m experiments.report RESULT.json DIR   (the JSON that --json wrote)")
    for written in replot(sys.argv[1], sys.argv[2]):
        print(f"wrote {written}")
