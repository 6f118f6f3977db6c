"""EcoServe's headline comparison (ecoserve.txt §4, Fig. 10 and its text): the request rate each
system sustains at equal normalized latency, OPT-13B on one A100-80G with 12 GB of KV cache.

Setup, from §2 "Machine settings" and §4 "Experiment Settings", fixed here before any run:
- OPT-13B on one A100-80G; "the memory for KVC is 12GB"; block size 32; Poisson arrivals.
- ShareGPT-like lengths (synthetic: sim/workloads.py, EcoServe's Table 2 means 161/338).
- A rising rate: the same seeded trace shape at each rate of `RATES` (Fig. 10's x axis).
- EcoServe: the ecoserve policy over exact allocation with the paper's KV pipelining buffer b
  = 15% of the (host's) predicted RL on ShareGPT (§4).
  The paper predicts RLs with a fine-tuned OPT-13B, which we do not have, so the predictor's
  error is a parameter (`sched/predictor.py`): "EcoServe" gets the true lengths with the
  paper's reported error on ShareGPT (73.2% within ±15%, §2.3: `NoisyOraclePredictor`);
  "EcoServe (learned RL)" gets `BucketQuantilePredictor` warm-started on 7,000 held-out
  requests (the paper fine-tunes on 70% of 10k held-out ones) and learning online; "EcoServe
  (oracle RL)" gets the true lengths, the paper's own variant. Sanity order, if allocation is
  right: oracle >= noisy >= learned.
- The baselines, from sim/experiments/baselines.py, as §2.1 names them: "vLLM [13] with the
  KVC swapping strategy" is vLLM (2023), prefill-first over the swap manager; "FastGen [14]
  with the recomputation strategy" is fcfs (chunked prefill, recompute: vLLM v1's scheduler,
  which earlier runs labelled "vLLM"); ORCA is max-allocation (exact allocation with no
  predictor: every request reserves prompt + max_tokens) with batch size 8 ("The batch size of
  ORCA ... was set to 8"). "vLLM v0, recompute" (prefill-first over paged) is ours: the 2023
  scheduler with vLLM's default recompute, kept to show what the swap costs.

Normalized latency is "the mean of every request's end-to-end latency divided by its output
length" (§4). "Sustains" is read as: the highest rate whose normalized latency stays within
`LATENCY_FACTOR` x the best system's at the lowest rate (light load), interpolated linearly
between the two rates around the crossing. The paper compares at "similar latencies" without
giving its threshold, so the factor is ours, fixed here and the same for every system.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from nanoserve.sched.predictor import (PAPER_PREDICTION_ERROR, BucketQuantilePredictor, NoisyOraclePredictor,
                                       OraclePredictor)
from nanoserve.sim.experiments import Comparison, ExperimentResult, check_scale
from nanoserve.sim.experiments.baselines import FASTGEN, ORCA, VLLM_2023, VLLM_2023_RECOMPUTE, Baseline
from nanoserve.sim.metrics import summarize
from nanoserve.sim.simulation import SimConfig, simulate
from nanoserve.sim.workloads import LENGTHS, TraceRequest, make_trace, poisson_arrivals

LENGTH_DIST = LENGTHS["sharegpt-ecoserve"]
BASE = SimConfig(model="OPT-13B", gpu="A100-80G", kv_bytes=12e9, block_size=32)
PIPELINE_BUFFER_RATIO = 0.15  # §4: b = 15% of the predicted RL on ShareGPT
RATES = {"paper": (0.25, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0), "ci": (0.25, 1.0, 2.0, 3.0, 4.0)}
REQUESTS = {"paper": 1000, "ci": 150}
LATENCY_FACTOR = 2.0
TABLE_RATE = {"paper": 3.0, "ci": 3.0}  # the rate whose runs fill the per-request tables and plots
PAPER_CLAIM = ("ShareGPT, Fig. 10: 2.5-4x vs vLLM, 1.25-2.25x vs FastGen, 22-64x vs ORCA (OPT-13B over the three "
               "traces: 1.28-2.33x, 1.20-2.33x, 3.5-25x)")
FIGURE = "EcoServe Fig. 10, ShareGPT"


@dataclass(frozen=True)
class System:
    label: str
    config: Callable[[list[TraceRequest]], SimConfig]  # the trace in, for the oracle's lengths


def _ecoserve(predictor: Callable[[list[TraceRequest]], object]) -> Callable[[list[TraceRequest]], SimConfig]:
    def config(trace: list[TraceRequest]) -> SimConfig:
        options = {"predicted_len": predictor(trace), "pipeline_buffer_ratio": PIPELINE_BUFFER_RATIO}
        return SimConfig(**{**BASE.__dict__, "policy": "ecoserve", "kv_manager_options": options})
    return config


def _true_lengths(trace: list[TraceRequest]) -> dict[str, int]:
    return {f"sim-{i}": r.output_len for i, r in enumerate(trace)}  # simulate() names the i-th "sim-i"


def _oracle(trace: list[TraceRequest]) -> OraclePredictor:
    return OraclePredictor(_true_lengths(trace))


def _noisy(trace: list[TraceRequest]) -> NoisyOraclePredictor:
    return NoisyOraclePredictor(_true_lengths(trace), PAPER_PREDICTION_ERROR["sharegpt"])


HELD_OUT = 7000  # §2.3: 10k requests per trace for fine-tuning, 70% of them for training
HELD_OUT_SEED = 10_000  # a slice no trace of the sweep draws


def _learned(trace: list[TraceRequest]) -> BucketQuantilePredictor:
    return BucketQuantilePredictor().warm(LENGTH_DIST.sample(HELD_OUT, HELD_OUT_SEED))


def _baseline(baseline: Baseline) -> System:
    return System(baseline.label, lambda trace: baseline.sim_config(BASE))


SYSTEMS = (
    System("EcoServe", _ecoserve(_noisy)),
    System("EcoServe (learned RL)", _ecoserve(_learned)),
    System("EcoServe (oracle RL)", _ecoserve(_oracle)),
    _baseline(VLLM_2023),
    _baseline(FASTGEN),
    _baseline(VLLM_2023_RECOMPUTE),
    _baseline(ORCA),
)


def sustained_rate(points: list[tuple[float, float]], threshold: float) -> float:
    """The rate where normalized latency first crosses `threshold`, by linear interpolation
    between the sweep's rates; the lowest rate's share of it if even that is over, the highest
    rate if none is (a lower bound then)."""
    points = sorted(points)
    if points[0][1] > threshold:
        return points[0][0] * threshold / points[0][1]
    for (r0, l0), (r1, l1) in zip(points, points[1:]):
        if l1 > threshold:
            return r0 + (r1 - r0) * (threshold - l0) / (l1 - l0)
    return points[-1][0]


def run(scale: str = "paper", seed: int = 0) -> ExperimentResult:
    check_scale(scale)
    n = REQUESTS[scale]
    sweep: dict[str, list[tuple[float, float]]] = {s.label: [] for s in SYSTEMS}
    rows, runs = [], {}
    for rate in RATES[scale]:
        trace = make_trace(poisson_arrivals(rate, n=n, seed=seed), LENGTH_DIST, seed=seed)
        for system in SYSTEMS:
            result = simulate(system.config(trace), trace)
            summary = summarize(result)["all"]
            sweep[system.label].append((rate, summary.norm_latency_mean))
            rows.append({"system": system.label, "rate": rate, "norm_latency": summary.norm_latency_mean,
                         "ttft_p99": summary.ttft_p99, "throughput_tok_s": summary.throughput_tok_s,
                         "preemptions": summary.preemptions, "steps": result.steps})
            if rate == TABLE_RATE[scale]:
                runs[system.label] = result
    light = min(points[0][1] for points in sweep.values())
    threshold = LATENCY_FACTOR * light
    sustained = {label: sustained_rate(points, threshold) for label, points in sweep.items()}
    eco = sustained["EcoServe"]
    comparisons = [
        Comparison(f"sustained rate: EcoServe / {VLLM_2023.label}", eco / sustained[VLLM_2023.label],
                   "2.5-4x higher", 2.5, f"vLLM with the KVC swapping strategy ({FIGURE})"),
        Comparison(f"sustained rate: EcoServe / {FASTGEN.label}", eco / sustained[FASTGEN.label],
                   "1.25-2.25x higher", 1.25, f"FastGen with the recomputation strategy ({FIGURE})"),
        Comparison(f"sustained rate: EcoServe / {ORCA.label}", eco / sustained[ORCA.label], "22-64x higher", 22,
                   f"ORCA, batch 8 ({FIGURE})"),
        Comparison(f"sustained rate: EcoServe / {VLLM_2023_RECOMPUTE.label}", eco / sustained[VLLM_2023_RECOMPUTE.label],
                   "(not run by the paper)", None, "none"),
        Comparison("sustained rate: EcoServe (paper's RL error) / EcoServe (oracle RL)",
                   eco / sustained["EcoServe (oracle RL)"], "oracle reaches 8% higher on OPT-13B (0.93x)", None,
                   "none"),
        Comparison("sustained rate: EcoServe (paper's RL error) / EcoServe (learned RL)",
                   eco / sustained["EcoServe (learned RL)"], "(sanity: >= 1 if allocation is right)", None, "none"),
    ]
    notes = [f"normalized-latency threshold {threshold * 1e3:.1f} ms/token ({LATENCY_FACTOR:g}x the lightest "
             f"load's best); sustained req/s: " + ", ".join(f"{k} {v:.2f}" for k, v in sustained.items()),
             "EcoServe here is SyncDecoupled as the paper states it: a PT holds its prompt's KV, charged to the "
             "reserved pool; its GT waits in Q_G for its padded predicted RL; a GT that cannot grow pauses, keeping "
             "its KV; hosting needs RL < host RL / 2 - b. benchmarks/RESULTS.md discusses the gap to the paper.",
             "Predictors: \"EcoServe\" has the paper's ShareGPT error (73.2% within ±15%; misses half under, half "
             "over, up to 50% beyond the band: an assumption), \"learned\" a bucket-quantile predictor warm-started "
             f"on {HELD_OUT} held-out requests (the synthetic trace draws prompt and output lengths independently, so "
             "it can only learn the global distribution), \"oracle\" the true lengths. Sustained req/s in that "
             "order: " + ", ".join(f"{sustained[k]:.2f}" for k in ("EcoServe (oracle RL)", "EcoServe",
                                                                      "EcoServe (learned RL)")) + "."]
    return ExperimentResult(
        name="ecoserve",
        title=f"EcoServe vs vLLM (2023), FastGen-like and ORCA: OPT-13B, A100-80G, 12 GB KV, Poisson {RATES[scale][0]:g}-"
              f"{RATES[scale][-1]:g} req/s, {n} requests per rate",
        workload=LENGTH_DIST.label, runs=runs, comparisons=comparisons, notes=notes,
        extra={"sweep": rows, "sustained_rate": sustained, "threshold_s_per_token": threshold,
               "paper_claim": PAPER_CLAIM, "table_rate": TABLE_RATE[scale]})


__all__ = ["RATES", "SYSTEMS", "run", "sustained_rate"]
