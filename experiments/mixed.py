"""`all`: every policy on one workload where the four papers' problems happen at once. No paper
ran this; it asks which policy wins when online bursts throttle memory (KunServe), output
lengths are unknown up front (EcoServe), best-effort work shares the GPU with real-time work
(BROS), and offline batches should soak up idle capacity without hurting the online SLO
(ConServe).

The workload, fixed here before any policy runs and the same for all of them:
- Llama-2-7B on one A100-40G with 256 GB of host memory for swapped-out and checkpointed KV
  (ConServe's setup, `conserve.Setup`: after the weights, ~17 GB of KV on the device, ~490k
  tokens' worth on the host). Until 2026-11-25 the host part was left out, and the policies with
  a host store got the simulator's default, a store the size of the device's KV (~39k tokens):
  BROS filled it with swapped-out BE requests, which Alg. 1 line 17 serves last, and every
  later preemption recomputed (RESULTS.md, "BROS's copies overlapped ...").
- Online: ShareGPT-like lengths (synthetic, EcoServe's statistics), BurstGPT-like arrivals
  (the rate steps x2-3 for 15 s, about once a minute). The base rate is 60% of what the GPU
  can serve, after KunServe's rule for its traces (kunserve.txt §5: "the average memory demand
  is lower than 60% of the total memory"), applied to whichever resource binds first: here
  compute, since a 7B model leaves an A100-40G room for ~40k tokens of KV. `base_rate`
  measures the capacity as fcfs's throughput on online requests that all arrive at once.
  Inside a burst the load is 120-180% of capacity: the queue and the KV cache fill.
- Offline: BROS's best-effort batches (512-1024 prompt, 32-128 output tokens) every
  `BATCH_EVERY` seconds, as bros.txt §6 submits its BE requests periodically. Each batch holds
  the remaining 40% of the capacity for that period (measured the same way, on BE requests),
  so the mean load is 100%: a GPU that is never idle in theory, where every policy decides who
  waits, and the bursts push it over.
- SLOs: the engine's defaults (online TTFT 1 s, TPOT 100 ms; offline none).

Each policy runs with the KV manager its paper assumes (sched.POLICY_MEMORY); EcoServe learns
its length predictor online (BucketQuantilePredictor). What is reported per policy: online
P99 TTFT and TPOT, online SLO attainment, offline and total throughput. The comparisons put
each policy against fcfs (vLLM) on online P99 TTFT and on total throughput.
"""
from __future__ import annotations

from experiments import Comparison, ExperimentResult, check_scale, conserve
from nanoserve.memory.predictor import BucketQuantilePredictor
from nanoserve.sched import SCHEDULERS
from nanoserve.sim.metrics import kv_usage_summary, summarize
from nanoserve.sim.simulation import SimConfig, SimResult, simulate
from nanoserve.sim.workloads import LENGTHS, LengthDist, TraceRequest, bursty_arrivals, make_trace, merge_traces
from nanoserve.slo import RequestClass

SETUP = conserve.SETUPS["paper"]  # its GPU, model and host memory; its own SLO and workload aside
BASE = SimConfig(model=SETUP.model, gpu=SETUP.gpu, host_kv_tokens=SETUP.host_kv_tokens())
ONLINE, OFFLINE = LENGTHS["sharegpt-ecoserve"], LENGTHS["bros-be"]
TARGET_LOAD = 0.6  # KunServe §5
PROBE_REQUESTS = 400
DURATION = {"paper": 600.0, "ci": 120.0}  # seconds of online arrivals
BATCH_EVERY = 60.0
# Runs stop this long after the first arrival (SimConfig.horizon): a policy that falls behind
# would take hours of wall time to drain. What is left counts as SLO misses (sim/metrics.py).
HORIZON = {"paper": 1200.0, "ci": 300.0}


def capacity(lengths: LengthDist, seed: int = 0) -> float:
    """Requests per second fcfs completes when `PROBE_REQUESTS` of them arrive at once: what the
    GPU can serve of this length mix."""
    trace = make_trace([0.0] * PROBE_REQUESTS, lengths, seed=seed)
    return PROBE_REQUESTS / simulate(SimConfig(**{**BASE.__dict__, "policy": "fcfs"}), trace).duration


def workload(scale: str, seed: int) -> tuple[list[TraceRequest], float, int]:
    """The trace, the online base rate and the offline batch size."""
    rate = TARGET_LOAD * capacity(ONLINE, seed)
    batch = round((1 - TARGET_LOAD) * capacity(OFFLINE, seed) * BATCH_EVERY)
    online = make_trace(bursty_arrivals(rate, duration=DURATION[scale], seed=seed), ONLINE, seed=seed)
    batches = int(DURATION[scale] // BATCH_EVERY)
    offline_arrivals = [k * BATCH_EVERY for k in range(batches) for _ in range(batch)]
    offline = make_trace(offline_arrivals, OFFLINE, seed=seed + 1, priority=RequestClass.OFFLINE)
    return merge_traces(online, offline), rate, batch


def config(policy: str, scale: str = "paper") -> SimConfig:
    """The policy with its paper's memory; BROS also streams its copies layer by layer, as its §4.1
    prices a step at max(T_exec, T_swap) (the other papers state no such overlap)."""
    options = {"predicted_len": BucketQuantilePredictor()} if policy == "ecoserve" else None
    return SimConfig(**{**BASE.__dict__, "policy": policy, "kv_manager_options": options, "horizon": HORIZON[scale],
                        "layerwise_copies": policy == "bros"})


def run(scale: str = "paper", seed: int = 0) -> ExperimentResult:
    check_scale(scale)
    trace, rate, batch = workload(scale, seed)
    runs: dict[str, SimResult] = {policy: simulate(config(policy, scale), trace) for policy in SCHEDULERS}
    rows = []
    for policy, result in runs.items():
        s = summarize(result)
        online, offline = s[RequestClass.ONLINE], s.get(RequestClass.OFFLINE)
        rows.append({"system": policy, "online_ttft_p99": online.ttft_p99, "online_tpot_p99": online.tpot_p99,
                     "online_slo": online.slo_attainment,
                     "offline_tok_s": offline.throughput_tok_s if offline else 0.0,
                     "total_tok_s": s["all"].throughput_tok_s, "preemptions": s["all"].preemptions,
                     "kv_mean": kv_usage_summary(result)["mean"], "unfinished": s["all"].unfinished})
    fcfs = next(row for row in rows if row["system"] == "fcfs")
    comparisons = []
    for row in rows:
        if row["system"] == "fcfs":
            continue
        comparisons.append(Comparison(f"online P99 TTFT: fcfs / {row['system']}",
                                      fcfs["online_ttft_p99"] / row["online_ttft_p99"], "no paper made this comparison",
                                      None, "none"))
        comparisons.append(Comparison(f"total throughput: {row['system']} / fcfs",
                                      row["total_tok_s"] / fcfs["total_tok_s"], "no paper made this comparison",
                                      None, "none"))
    meets = [row for row in rows if row["online_slo"] >= 0.9]
    best = max(meets, key=lambda row: row["total_tok_s"])["system"] if meets else None
    notes = [f"online base rate {rate:.2f} req/s (60% of capacity), x2-3 in bursts; "
             f"{batch} offline requests every {BATCH_EVERY:g} s",
             f"highest total throughput among policies with >= 90% online SLO attainment: {best or 'none'}",
             f"runs stop {HORIZON[scale]:g} s after the first arrival; requests left then (SLO misses, counted "
             "with the time they had waited): " + ", ".join(f"{row['system']} {row['unfinished']}" for row in rows)]
    return ExperimentResult(
        name="all",
        title=f"every policy, one mixed workload: Llama-2-7B, A100-40G, {DURATION[scale]:g} s of bursty online "
              f"+ periodic offline batches",
        workload=f"online {ONLINE.label}, BurstGPT-like arrivals; offline {OFFLINE.label}",
        runs=runs, comparisons=comparisons, notes=notes,
        extra={"policies": rows, "online_base_rate": rate, "offline_batch": batch})


__all__ = ["capacity", "run", "workload"]
