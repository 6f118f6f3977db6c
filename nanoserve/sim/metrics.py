"""What a simulated run achieved: per-class latency statistics, SLO attainment, throughput and
KV usage, as a `Summary`, a markdown table, a JSON file and PNG plots.

Percentiles here interpolate linearly between order statistics (numpy's default), unlike the
engine's online `slo.percentile` (nearest rank over a window): offline reports compare policies
on small samples, where interpolation is steadier. SLO attainment reuses `SLO.attained`, so a
simulated request meets its SLO exactly when the real engine would count it as met.

The workloads behind these runs are synthetic stand-ins for the papers' datasets (see
sim/workloads.py); `to_json` requires a workload note and the table and plots accept one, so no
output passes them off as real traces.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanoserve.sim.simulation import RequestRecord, SimResult
from nanoserve.slo import PRIORITIES, RequestClass

MAX_KV_POINTS = 500  # kv_usage samples kept per run in the JSON (one per engine step otherwise)


@dataclass(frozen=True)
class Summary:
    # Labels: which run and which requests these statistics describe.
    policy: str
    gpu: str
    model: str
    request_class: str  # "all", or a RequestClass ("online" | "offline")
    count: int
    # Latencies in seconds. TPOT statistics are None when no request had a TPOT (1-token outputs).
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    tpot_p50: float | None
    tpot_p90: float | None
    tpot_p99: float | None
    e2e_p50: float
    e2e_p99: float
    # e2e / output_len: seconds per output token, the normalized latency of Orca, vLLM, EcoServe.
    norm_latency_mean: float
    norm_latency_p50: float
    norm_latency_p99: float
    slo_attainment: float  # fraction of the class's requests that met their class's SLO
    output_tokens: int
    throughput_tok_s: float  # output tokens / the run's duration
    throughput_req_s: float  # requests / the run's duration
    preemptions: int
    unfinished: int = 0  # cut off by SimConfig.horizon: counted as SLO misses


def percentile(values: Iterable[float | None], q: float) -> float:
    """The q-th percentile (0-100), interpolating linearly between order statistics as
    `numpy.percentile` does by default. None values are skipped (a missing measurement, e.g.
    the TPOT of a one-token output, is not a zero); raises ValueError if none remain."""
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    ordered = sorted(v for v in values if v is not None)
    if not ordered:
        raise ValueError("percentile of no values")
    pos = q / 100 * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _maybe_percentile(values: list[float | None], q: float) -> float | None:
    return percentile(values, q) if any(v is not None for v in values) else None


def _summary(result: SimResult, request_class: str, records: list[RequestRecord]) -> Summary:
    config = result.config
    slos = {RequestClass.ONLINE: config.online_slo, RequestClass.OFFLINE: config.offline_slo}
    # A request the horizon cut off counts with the time it had waited (`SimResult.waited`).
    ttfts = [result.waited(r) if r.ttft is None and r.e2e is None else r.ttft for r in records]
    tpots = [r.tpot for r in records]
    e2es = [result.waited(r) for r in records]
    norm = [e2e / r.output_len for e2e, r in zip(e2es, records) if r.output_len > 0]
    tokens = sum(r.output_len for r in records if r.e2e is not None)
    # Every class divides by the whole run's duration, so per-class throughputs add up to "all".
    duration = result.duration
    return Summary(
        policy=config.policy, gpu=config.gpu, model=config.model, request_class=request_class,
        count=len(records),
        ttft_p50=percentile(ttfts, 50), ttft_p90=percentile(ttfts, 90), ttft_p99=percentile(ttfts, 99),
        tpot_p50=_maybe_percentile(tpots, 50), tpot_p90=_maybe_percentile(tpots, 90),
        tpot_p99=_maybe_percentile(tpots, 99),
        e2e_p50=percentile(e2es, 50), e2e_p99=percentile(e2es, 99),
        norm_latency_mean=sum(norm) / len(norm), norm_latency_p50=percentile(norm, 50),
        norm_latency_p99=percentile(norm, 99),
        slo_attainment=sum(r.e2e is not None and slos[r.priority].attained(r.ttft, r.tpot, r.e2e, r.output_len)
                           for r in records) / len(records),
        output_tokens=tokens,
        throughput_tok_s=tokens / duration if duration > 0 else math.nan,
        throughput_req_s=len(records) / duration if duration > 0 else math.nan,
        preemptions=sum(r.preemptions for r in records),
        unfinished=sum(r.e2e is None for r in records),
    )


def summarize(result: SimResult) -> dict[str, Summary]:
    """Statistics over all requests ("all") and per class (keyed by RequestClass, so "online" and
    "offline" find them too); empty classes are left out."""
    groups: dict[str, list[RequestRecord]] = {"all": list(result.records)}
    for priority in PRIORITIES:
        groups[priority] = [r for r in result.records if r.priority is priority]
    return {name: _summary(result, name, records) for name, records in groups.items() if records}


def kv_usage_summary(result: SimResult) -> dict[str, float]:
    """Time-weighted mean and peak of the fraction of KV blocks in use. Each sample is taken after
    a step and holds until the next one, so a sample weighs as much as the time it was in force
    (a plain mean would over-weight bursts of short steps). The last sample has no duration; a
    series with no elapsed time falls back to the plain mean."""
    series = result.kv_usage
    if not series:
        return {"mean": 0.0, "peak": 0.0}
    peak = max(u for _, u in series)
    span = series[-1][0] - series[0][0]
    if span <= 0:
        return {"mean": sum(u for _, u in series) / len(series), "peak": peak}
    area = sum(u * (t1 - t0) for (t0, u), (t1, _) in zip(series, series[1:]))
    return {"mean": area / span, "peak": peak}


# ----------------------------------------------------------------------------- markdown table
def _fmt(value: float | None, scale: float = 1.0, digits: int = 1, suffix: str = "") -> str:
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value * scale:.{digits}f}{suffix}"


def _stat(attr: str, scale: float = 1.0, digits: int = 1, suffix: str = "") -> Callable[[str, Summary], str]:
    return lambda label, s: _fmt(getattr(s, attr), scale, digits, suffix)


# Column name -> (header, cell). Latencies are shown in ms, which reads better than seconds here.
COLUMNS: dict[str, tuple[str, Callable[[str, Summary], str]]] = {
    "label": ("label", lambda label, s: label.replace("|", "\\|")),
    "policy": ("policy", lambda label, s: s.policy),
    "gpu": ("GPU", lambda label, s: s.gpu),
    "model": ("model", lambda label, s: s.model),
    "class": ("class", lambda label, s: s.request_class),
    "count": ("requests", lambda label, s: str(s.count)),
    "preemptions": ("preemptions", lambda label, s: str(s.preemptions)),
    **{f"{m}_{p}": (f"{m.upper()} {p} (ms)", _stat(f"{m}_{p}", 1e3))
       for m in ("ttft", "tpot") for p in ("p50", "p90", "p99")},
    **{f"e2e_{p}": (f"e2e {p} (s)", _stat(f"e2e_{p}", digits=2)) for p in ("p50", "p99")},
    **{f"norm_latency_{p}": (f"norm. latency {p} (ms/tok)", _stat(f"norm_latency_{p}", 1e3))
       for p in ("mean", "p50", "p99")},
    "slo_attainment": ("SLO attainment", _stat("slo_attainment", 100, suffix="%")),
    "throughput_tok_s": ("throughput (tok/s)", _stat("throughput_tok_s")),
    "throughput_req_s": ("throughput (req/s)", _stat("throughput_req_s", digits=2)),
}
DEFAULT_COLUMNS = ("label", "class", "count", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99",
                   "norm_latency_p50", "slo_attainment", "throughput_tok_s")


def markdown_table(rows: list[tuple[str, Summary]], columns: Sequence[str] = DEFAULT_COLUMNS,
                   workload: str | None = None) -> str:
    """A GitHub markdown table, one row per (label, summary); `columns` name keys of COLUMNS.
    With `workload`, a line under the table says what the (synthetic) workload was."""
    unknown = [c for c in columns if c not in COLUMNS]
    if unknown:
        raise ValueError(f"unknown columns {unknown}; choose from {list(COLUMNS)}")
    lines = ["| " + " | ".join(COLUMNS[c][0] for c in columns) + " |",
             "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(COLUMNS[c][1](label, s) for c in columns) + " |" for label, s in rows]
    if workload:
        lines += ["", f"Workload: {workload}"]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- JSON
def _jsonable(value: Any) -> Any:
    """Plain JSON values: mappings and sequences recursively, non-finite floats as null (strict
    JSON has no NaN), anything else unknown as its str."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)


def downsample(series: Sequence[tuple[float, float]], max_points: int = MAX_KV_POINTS) -> list[tuple[float, float]]:
    """At most `max_points` evenly spaced samples, always keeping the first and last."""
    if len(series) <= max_points:
        return list(series)
    step = (len(series) - 1) / (max_points - 1)
    return [series[round(i * step)] for i in range(max_points)]


def to_json(results: Mapping[str, SimResult], path: str | Path, *, workload: str,
            extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write every labelled run (config, summaries, counters, down-sampled KV usage) to `path`.
    `workload` is required and stored as the top-level "workload_note" (e.g. "ShareGPT-like
    (synthetic)"), so the file itself says the traces were synthetic."""
    if not workload:
        raise ValueError("workload must describe the (synthetic) workload")
    runs = {}
    for label, result in results.items():
        runs[label] = {
            "config": dataclasses.asdict(result.config),
            "summaries": {name: dataclasses.asdict(s) for name, s in summarize(result).items()},
            "kv_usage_summary": kv_usage_summary(result),
            "events": result.events, "steps": result.steps, "busy_seconds": result.busy_seconds,
            "link_busy_seconds": result.link_busy_seconds, "forward_stall_seconds": result.forward_stall_seconds,
            "duration": result.duration,
            "kv_usage": downsample(result.kv_usage), "extra": result.extra,
        }
    data = _jsonable({"workload_note": workload, "results": runs, "extra": extra or {}})
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")
    return data


# ----------------------------------------------------------------------------- plots
def slugify(text: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return slug or "sim"


def plot(results: Mapping[str, SimResult], directory: str | Path, title: str,
         workload: str | None = None) -> list[Path]:
    """Three PNGs named after `title`: TTFT against arrival time, KV usage over time, and CDFs
    of TTFT and TPOT, each with one series per label. `workload` is added to every title."""
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError("plot() needs matplotlib: pip install 'nanoserve[bench]'") from exc
    matplotlib.use("Agg")  # files only; never open a window (CI, headless servers)
    import matplotlib.pyplot as plt

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    slug, heading = slugify(title), title + (f"\n{workload}" if workload else "")
    paths = []

    def save(fig: Any, name: str) -> None:
        fig.suptitle(heading)
        fig.tight_layout()
        paths.append(out / f"{slug}-{name}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, result in results.items():
        start = min((r.arrival for r in result.records), default=0.0)
        points = [(r.arrival - start, r.ttft) for r in result.records if r.ttft is not None]
        ax.scatter([p[0] for p in points], [p[1] for p in points], s=6, alpha=0.6, label=label)
    ax.set(xlabel="arrival time (s)", ylabel="TTFT (s)", yscale="log")
    ax.legend()
    save(fig, "ttft-over-time")

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, result in results.items():
        series = downsample(result.kv_usage, 5000)  # enough for a plot, cheap to draw
        # Time from the first arrival, the same origin as the TTFT plot.
        t0 = min((r.arrival for r in result.records), default=series[0][0] if series else 0.0)
        ax.step([t - t0 for t, _ in series], [u * 100 for _, u in series], where="post", label=label)
    ax.set(xlabel="time (s)", ylabel="KV blocks used (%)", ylim=(0, 105))
    ax.legend()
    save(fig, "kv-usage")

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, metric in zip(axes, ("ttft", "tpot")):
        for label, result in results.items():
            values = sorted(v for r in result.records if (v := getattr(r, metric)) is not None)
            if values:
                ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=label)
        ax.set(xlabel=f"{metric.upper()} (s)", ylabel="fraction of requests", xscale="log", ylim=(0, 1.02))
        ax.legend()
    save(fig, "latency-cdf")
    return paths
