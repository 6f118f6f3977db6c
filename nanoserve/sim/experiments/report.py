"""How an `ExperimentResult` is shown: the text `examples/simulate.py` prints, its JSON file and
its plots. Every output carries the workload's label, which says the trace is synthetic.

The text has three parts: the per-run table (sim/metrics.py's columns, one row per run and
request class), the comparisons (our ratio next to the paper's claim, and whether we reach its
low end), and the experiment's notes. A rate sweep (`extra["sweep"]`, EcoServe and BROS) also
gets its own table and a latency-against-rate plot, as the papers draw it.
"""
from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any

from nanoserve.sim.experiments import Comparison, ExperimentResult
from nanoserve.sim.metrics import markdown_table, plot, slugify, summarize, to_json

COLUMNS = ("label", "class", "count", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "norm_latency_mean",
           "slo_attainment", "throughput_tok_s", "preemptions")


TABLES = ("sweep", "policies")  # extra[...] lists of rows an experiment may add


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
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "|".join("---" for _ in keys) + "|"]
    for row in rows:
        cells = [f"{v:.4g}" if isinstance(v, float) else str(v) for v in row.values()]
        lines.append("| " + " | ".join(cells) + " |")
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
    return paths


def _sweep_plot(result: ExperimentResult, rows: list[dict[str, Any]], directory: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = next(k for k in ("norm_latency", "rt_norm_latency") if k in rows[0])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for system in dict.fromkeys(row["system"] for row in rows):
        points = sorted((row["rate"], row[metric]) for row in rows if row["system"] == system)
        ax.plot([p[0] for p in points], [p[1] * 1e3 for p in points], marker="o", label=system)
    threshold = result.extra.get("threshold_s_per_token")
    if threshold:
        ax.axhline(threshold * 1e3, color="grey", linestyle="--", label="sustained-rate threshold")
    ax.set(xlabel="request rate (req/s)", ylabel="normalized latency (ms/token)", yscale="log")
    ax.set_title("\n".join(textwrap.wrap(f"{result.name}: {result.title}", 90) + [result.workload]), fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = directory / f"{slugify(result.name)}-sweep.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
