"""The papers' headline comparisons, re-run in the simulator (`examples/simulate.py EXPERIMENT`).

Each experiment is one module with a `run(scale="paper", seed=0) -> ExperimentResult`:

    kunserve   kunserve.txt §5: P99 TTFT under bursts, drop + lookahead vs vLLM and vLLM-PP
    ecoserve   ecoserve.txt §4: sustainable rate at equal normalized latency vs vLLM (2023, swap),
               FastGen and ORCA
    bros       bros.txt §7.2.1: RT normalized latency and BE throughput vs vLLM (2023, swap) and RR
    conserve   conserve.txt §6: throughput and online P99 vs Online-Only and vLLM++ (swap)
    all        every policy on one mixed workload (no paper made this comparison)

The baselines are the papers' own, from one table (baselines.py), next to stronger ones of ours.

Rules every experiment keeps (issue 7): the workload's parameters are fixed in the module before
any policy runs, and every policy sees the same seeded trace; the trace is synthetic and its
label says so; `scale="ci"` is the same experiment on a few hundred requests, for the tests,
which assert only who wins, with a margin.

A `Comparison` puts our ratio next to the paper's claim. Ratios are oriented so that > 1 means
the paper's policy wins (e.g. baseline P99 TTFT / policy P99 TTFT), and `paper_low` is the low
end of the paper's claimed effect in that orientation. `baseline` names what the paper's number
was measured against (experiments/baselines.py): a ratio is compared only with the paper's
number from the same figure and the same baseline, and a row whose baseline the paper did not
run says so ("none") instead of borrowing a headline.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from nanoserve.sim.simulation import SimResult

SCALES = ("paper", "ci")
# Scales only some experiments run: name -> the experiments that take it.
EXTRA_SCALES = {"long": ("kunserve",)}  # §5.4's 640 s BurstGPT run (KunServe's Fig. 15)

# name -> "module:function", imported on first use.
EXPERIMENTS: dict[str, str] = {
    "kunserve": "experiments.kunserve:run",
    "ecoserve": "experiments.ecoserve:run",
    "bros": "experiments.bros:run",
    "conserve": "experiments.conserve:run",
    "all": "experiments.mixed:run",
}


@dataclass(frozen=True)
class Comparison:
    metric: str  # what the ratio divides, e.g. "P99 TTFT: vLLM / KunServe"
    ours: float  # > 1: the paper's policy wins
    paper: str  # the paper's claim, as it states it, e.g. "12.7-72.2x lower"
    paper_low: float | None = None  # low end of the claim, as a ratio oriented like `ours`
    baseline: str = ""  # what the paper's number was measured against (its figure, its system)

    @property
    def same_direction(self) -> bool:
        return self.ours > 1

    @property
    def reaches_paper(self) -> bool | None:
        return None if self.paper_low is None else self.ours >= self.paper_low


@dataclass
class ExperimentResult:
    name: str
    title: str  # setup in words: model, GPU, workload, policies
    workload: str  # the synthetic workload's label, printed with every output
    runs: dict[str, SimResult]  # label (e.g. "KunServe", "vLLM") -> its run
    comparisons: list[Comparison]
    notes: list[str] = field(default_factory=list)  # why a result differs from the paper, caveats
    extra: dict[str, Any] = field(default_factory=dict)  # experiment-specific tables (e.g. a rate sweep)


def check_scale(scale: str, experiment: str | None = None) -> None:
    """`scale` is one every experiment runs, or one of `EXTRA_SCALES` that `experiment` runs."""
    if scale not in SCALES and experiment not in EXTRA_SCALES.get(scale, ()):
        extra = [s for s, names in EXTRA_SCALES.items() if experiment in names]
        raise ValueError(f"scale must be one of {(*SCALES, *extra)}, got {scale!r}")


def run_experiment(name: str, scale: str = "paper", seed: int = 0, **options: Any) -> ExperimentResult:
    """Run experiment `name`; `options` go to its `run` (e.g. ecoserve's `datasets`, `points`)."""
    try:
        module_name, function = EXPERIMENTS[name].split(":")
    except KeyError:
        raise ValueError(f"unknown experiment {name!r}; available: {', '.join(EXPERIMENTS)}") from None
    check_scale(scale, name)
    return getattr(importlib.import_module(module_name), function)(scale=scale, seed=seed, **options)
