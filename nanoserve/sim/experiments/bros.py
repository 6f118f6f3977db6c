"""BROS's headline comparison (bros.txt §7.2.1, Fig. 10(a)-(c)), re-run in the simulator: RT
normalized latency and BE throughput under BROS (sched/bros.py over memory/bidirectional_kv.py)
and the paper's baselines (sim/experiments/baselines.py): vLLM as the paper ran it, a 2024 vLLM
with whole-prompt prefill steps and swap preemption ("vLLM (2023)": prefill-first over the swap
manager), and BROS-Round-Robin (sched/round_robin.py, §2.2: RT and BE batches in turns, paged
memory, no bidirectional blocks). Two stronger baselines of ours show how much of the gain is the
paper's baseline: FastGen-like fcfs (vLLM v1's chunked prefill, recompute) and vLLM v0 with
recompute instead of swap.

The paper, on ShareGPT RT requests: "reductions of 74.20% and 54.31% in average normalized
latency, as compared to vLLM and RR at various request rates", with "only an 11.29% reduction
[of BE throughput] compared to vLLM and an 8.80% reduction compared to RR".

The workload, fixed here before any policy runs, from §7.1:
- OPT-13B at tensor parallelism 2 on A100-SXM4-40GB GPUs (the paper's OPT testbed); KV capacity
  is what the weights leave (§7.1 profiles "the maximum available GPU memory"); block size 16.
- SLOs: TTFT 0.4 s, TPOT 0.2 s (§7.1).
- RT: Poisson arrivals at each rate of `Setup.rates` (Fig. 10 sweeps 5-15 req/s; we stop at 10) for 600 s ("we
  evaluate the systems with 10-minute traces"), ShareGPT-like lengths with Table 2's moments
  (prompt 222.76 +- 256.36, output 234.51 +- 268.50: a lognormal of sigma 0.92), each side capped
  at 1,024 tokens to fit OPT's 2,048-token context.
- BE: prompts U(512, 1024), outputs U(32, 128) (§7.1, after FlexGen), "periodically submitted in
  a batch manner when previous batched requests are completed": closed loop
  (`ClosedLoopBatches`), the first batch at the start, each next one the moment the last request
  of the one before finishes, none after the RT trace ends. The paper gives no batch size:
  `be_batch` = 32 is ours (one batch alone keeps the GPUs busy `be_batch_alone_s` seconds, in
  extra).
- The same seeded RT trace per rate, and the same sequence of BE batches, for every policy
  (when each batch goes in depends on the policy).

BE throughput is the closed-loop quantity the paper measures: BE requests finished per second of
time during which BE work was in the system (the union over BE requests of [arrival, finish]).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from nanoserve.sim.experiments import Comparison, ExperimentResult, check_scale
from nanoserve.sim.experiments.baselines import FASTGEN, ROUND_ROBIN, VLLM_2023, VLLM_2023_RECOMPUTE, Baseline
from nanoserve.sim.simulation import SimConfig, SimResult, simulate
from nanoserve.sim.workloads import (LENGTHS, ClosedLoopBatches, LengthDist, TraceRequest, make_trace,
                                     poisson_arrivals)
from nanoserve.slo import SLO


@dataclass(frozen=True)
class Setup:
    gpu: str = "A100-40G"  # §7.1: A100-SXM4-40GB
    model: str = "OPT-13B"
    tp: int = 2  # §7.1: OPT-13B at tensor-parallel degree 2
    slo: SLO = SLO(ttft=0.4, tpot=0.2)  # §7.1
    # RT req/s. Fig. 10 sweeps 5-15; past 10 this deployment is far over capacity in our cost
    # model (vLLM meets TTFT for 4% at 12.5), and BROS, which keeps passing over thousands of
    # waiting requests the memory cannot take, needs hours of wall time per run there.
    rates: tuple[float, ...] = (5.0, 7.5, 10.0)
    duration: float = 600.0  # seconds of RT arrivals: "10-minute traces"
    be_batch: int = 32  # BE requests per closed-loop batch (ours; the paper gives none)
    # Virtual seconds after the first arrival at which a run stops: a system that falls into
    # overload may take hours of wall time to drain. Unfinished requests count as misses.
    horizon: float = 900.0


# ci: the same setup on ~300 RT requests at the middle rate, beside closed-loop BE batches for 30 s.
SETUPS = {"paper": Setup(), "ci": Setup(rates=(10.0,), duration=30.0, horizon=90.0)}
# Table 2, ShareGPT: sigma = sqrt(ln(1 + (std / mean)^2)) = 0.918 (prompt), 0.916 (output).
RT_LENGTHS = LengthDist("ShareGPT-like (BROS Table 2)", 222.76, 234.51, min_prompt=4, max_prompt=1024,
                        max_output=1024, sigma=0.92)
BE_LENGTHS = LENGTHS["bros-be"]
BROS = "BROS"
VLLM, VLLM_V0, FCFS, RR = VLLM_2023.label, VLLM_2023_RECOMPUTE.label, FASTGEN.label, ROUND_ROBIN.label
BASELINE_OF: dict[str, Baseline] = {b.label: b for b in (VLLM_2023, FASTGEN, VLLM_2023_RECOMPUTE, ROUND_ROBIN)}
POLICIES = {BROS: "bros", **{label: b.policy for label, b in BASELINE_OF.items()}}
BASELINES = tuple(BASELINE_OF)
# The paper's averages over rates, as reductions (§7.2.1, ShareGPT), against the two baselines
# it ran; the other two are ours, with no paper number.
PAPER_LATENCY_CUT = {VLLM: 0.7420, RR: 0.5431}
PAPER_THROUGHPUT_CUT = {VLLM: 0.1129, RR: 0.0880}
PAPER_BASELINE = {VLLM: "vLLM, 2024: prefill-first, swap (§7.2.1, Fig. 10, ShareGPT)",
                  RR: "BROS-Round-Robin (§7.2.1, Fig. 10, ShareGPT)"}


def be_batches(setup: Setup, seed: int) -> ClosedLoopBatches:
    """The BE batches, submitted closed loop from the start until the RT trace ends. More than any
    policy can finish: a batch takes at least a step per output token (32-128 of them)."""
    count = math.ceil(setup.duration / 0.5)
    pairs = BE_LENGTHS.sample(count * setup.be_batch, seed)
    batches = tuple(tuple(TraceRequest(0.0, *pairs[b * setup.be_batch + i], "offline") for i in range(setup.be_batch))
                    for b in range(count))
    return ClosedLoopBatches(batches, start=0.0, until=setup.duration)


def rt_trace(setup: Setup, rate: float, seed: int) -> list[TraceRequest]:
    return make_trace(poisson_arrivals(rate, duration=setup.duration, seed=seed), RT_LENGTHS, seed=seed + 1)


def be_busy_seconds(result: SimResult) -> float:
    """Length of the union of BE requests' [arrival, finish] intervals (unfinished: to the end)."""
    end = result.end
    spans = sorted((r.arrival, r.arrival + r.e2e if r.e2e is not None else end)
                   for r in result.records if r.priority == "offline" and r.arrival <= end)
    total, end = 0.0, -math.inf
    for start, finish in spans:
        if finish > end:
            total += finish - max(start, end)
            end = finish
    return total


def rt_stats(result: SimResult, slo: SLO) -> dict[str, float]:
    """Per-class numbers of one run. A request the horizon cut off misses both SLOs and counts
    in the normalized latency with the time it had waited so far (a lower bound)."""
    rt = [r for r in result.records if r.priority == "online"]
    be = [r for r in result.records if r.priority == "offline"]
    busy = be_busy_seconds(result)
    return {
        # §7.1: "the mean of each RT request's end-to-end latency divided by the number of its output tokens"
        "rt_norm_latency": sum(result.waited(r) / r.output_len for r in rt) / len(rt),
        "rt_ttft_attainment": sum(r.ttft is not None and r.ttft <= slo.ttft for r in rt) / len(rt),
        "rt_tpot_attainment": sum(r.e2e is not None and (r.tpot is None or r.tpot <= slo.tpot) for r in rt) / len(rt),
        "rt_ttft_p50": statistics.median(r.ttft if r.ttft is not None else math.inf for r in rt),
        "rt_unfinished": sum(r.e2e is None for r in rt),
        "be_unfinished": sum(r.e2e is None for r in be),
        "be_throughput_req_s": sum(r.e2e is not None for r in be) / busy if busy > 0 else math.nan,
        "be_busy_s": busy,
        "rt_preemptions": sum(r.preemptions for r in rt),
        "be_preemptions": sum(r.preemptions for r in be),
        "swap_outs": result.events.get("swap_outs", 0),
        # §5's bidirectional memory at work (BROS only): RT pages over BE slots, the BE slots
        # checkpointed for it, and the pages brought back.
        "overwrites": result.events.get("overwrites", 0),
        "checkpointed_slots": result.events.get("checkpointed_slots", 0),
        "restored_pages": result.events.get("restored_pages", 0),
        "link_busy_s": result.link_busy_seconds,
        "forward_stall_s": result.forward_stall_seconds,
        "steps": result.steps,
    }


def be_batch_alone_seconds(setup: Setup, seed: int) -> float:
    """How long one BE batch keeps the GPUs busy with nothing else running (vLLM's fcfs)."""
    batch = list(be_batches(setup, seed).batches[0])
    return simulate(FASTGEN.sim_config(_config(setup)), batch).duration


def _config(setup: Setup, system: str = BROS) -> SimConfig:
    base = SimConfig(policy="bros", gpu=setup.gpu, model=setup.model, tp=setup.tp, online_slo=setup.slo,
                     horizon=setup.horizon)
    return BASELINE_OF[system].sim_config(base) if system in BASELINE_OF else base


def _reduction_ratio(cuts: list[float]) -> float:
    """A mean reduction over rates, as the ratio baseline / BROS it amounts to (74% -> 3.85x)."""
    mean = sum(cuts) / len(cuts)
    return 1 / (1 - mean) if mean < 1 else math.inf


def run(scale: str = "paper", seed: int = 0) -> ExperimentResult:
    check_scale(scale)
    setup = SETUPS[scale]
    be = be_batches(setup, seed + 2)
    runs: dict[str, SimResult] = {}
    sweep: list[dict[str, float | str]] = []
    comparisons: list[Comparison] = []
    latency_cuts: dict[str, list[float]] = {base: [] for base in BASELINES}
    throughput_ratios: dict[str, list[float]] = {base: [] for base in BASELINES}
    for rate in setup.rates:
        trace = rt_trace(setup, rate, seed)
        stats = {}
        for label in POLICIES:
            result = simulate(_config(setup, label), trace, closed_loop=be)
            runs[f"{label} @ {rate:g} req/s"] = result
            stats[label] = rt_stats(result, setup.slo)
            sweep.append({"system": label, "rate": rate, **stats[label]})
        ours = stats[BROS]
        for base in BASELINES:
            latency = stats[base]["rt_norm_latency"] / ours["rt_norm_latency"]
            throughput = ours["be_throughput_req_s"] / stats[base]["be_throughput_req_s"]
            latency_cuts[base].append(1 - 1 / latency)
            throughput_ratios[base].append(throughput)
            ran = base in PAPER_LATENCY_CUT
            comparisons += [
                Comparison(f"RT normalized latency: {base} / BROS at {rate:g} req/s", latency,
                           f"{PAPER_LATENCY_CUT[base]:.2%} lower on average over rates (no per-rate figure)"
                           if ran else "(not run by the paper)", None, PAPER_BASELINE.get(base, "none")),
                Comparison(f"BE throughput: BROS / {base} at {rate:g} req/s (below 1 expected)", throughput,
                           f"{PAPER_THROUGHPUT_CUT[base]:.2%} lower on average over rates (no per-rate figure)"
                           if ran else "(not run by the paper)", None, PAPER_BASELINE.get(base, "none")),
            ]
    for base in BASELINES:
        ran = base in PAPER_LATENCY_CUT
        comparisons += [
            Comparison(f"RT normalized latency: {base} / BROS, mean reduction over rates",
                       _reduction_ratio(latency_cuts[base]),
                       f"{PAPER_LATENCY_CUT[base]:.2%} lower (§7.2.1)" if ran else "(not run by the paper)",
                       1 / (1 - PAPER_LATENCY_CUT[base]) if ran else None, PAPER_BASELINE.get(base, "none")),
            Comparison(f"BE throughput: BROS / {base}, mean over rates (below 1 expected; >= paper: as good or better)",
                       sum(throughput_ratios[base]) / len(throughput_ratios[base]),
                       f"{PAPER_THROUGHPUT_CUT[base]:.2%} lower (§7.2.1)" if ran else "(not run by the paper)",
                       1 - PAPER_THROUGHPUT_CUT[base] if ran else None, PAPER_BASELINE.get(base, "none")),
        ]
    alone = be_batch_alone_seconds(setup, seed + 2)
    return ExperimentResult(
        name="bros",
        title=(f"BROS vs vLLM (2023), RR and two stronger baselines (bros.txt §7.2.1): {setup.model} at TP={setup.tp} on "
               f"{setup.gpu}, RT Poisson {', '.join(f'{r:g}' for r in setup.rates)} req/s for {setup.duration:g} s "
               f"plus closed-loop batches of {setup.be_batch} BE requests; SLO TTFT "
               f"{setup.slo.ttft * 1e3:g} ms / TPOT {setup.slo.tpot * 1e3:g} ms"),
        workload=f"RT: {RT_LENGTHS.label}; BE: {BE_LENGTHS.label}",
        runs=runs, comparisons=comparisons, notes=notes(sweep, setup, alone),
        extra={"sweep": sweep, "be_batch_alone_s": alone},
    )


def notes(sweep: list[dict[str, float | str]], setup: Setup, alone: float) -> list[str]:
    def column(system: str, key: str) -> list[float]:
        return [float(row[key]) for row in sweep if row["system"] == system]

    def span(values: list[float], scale: float = 1.0, fmt: str = ".2f") -> str:
        lo, hi = min(values) * scale, max(values) * scale
        return f"{lo:{fmt}}" if f"{lo:{fmt}}" == f"{hi:{fmt}}" else f"{lo:{fmt}}-{hi:{fmt}}"

    attainment = "; ".join(
        f"{system}: TTFT {span(column(system, 'rt_ttft_attainment'), 100, '.0f')}%, "
        f"TPOT {span(column(system, 'rt_tpot_attainment'), 100, '.0f')}%" for system in POLICIES)
    return [
        "The paper states its reductions as averages over its rates and gives no per-rate number in the text, "
        "so only the mean over rates carries the paper's figure as its low end; a mean reduction r is shown as "
        "the ratio 1 / (1 - r) (74.20% -> 3.88x). BE throughput ratios are BROS / baseline: the paper expects "
        "BROS to lose some (0.89x vs vLLM, 0.91x vs RR), so a ratio below 1 is the expected direction, and "
        "one at or above the paper's figure means BROS lost no more than the paper says.",
        f"SLO attainment over rates ({attainment}). The paper's averages: vLLM TTFT 1.28%, RR TTFT 10.55%, "
        "TPOT RR 47.34% and BROS 65.49%.",
        f"One BE batch alone keeps the GPUs busy for {alone:.1f} s. BE busy time (BE work in the system) per "
        f"system, over rates: " + "; ".join(
            f"{s} {span(column(s, 'be_busy_s'), 1 / (setup.duration + 1e-9) * 100, '.0f')}% of the trace"
            for s in POLICIES) + ".",
        "The paper's vLLM (2024) prefilled whole prompts in steps of their own and swapped under memory "
        f"pressure: {VLLM} stands for it (sim/experiments/baselines.py). {FCFS} is nanoserve's fcfs, vLLM v1's "
        "scheduler with chunked prefill, which never stalls running decodes behind a prompt; it and "
        f"{VLLM_V0} are ours, stronger, with no paper number. Swap-outs per rate, vLLM (2023): "
        f"{', '.join(str(int(v)) for v in column(VLLM, 'swap_outs'))}.",
        f"Runs stop {setup.horizon:g} s after the first arrival; requests still in the system then miss both "
        "SLOs and count with the time they had waited. Unfinished RT requests per rate: " + "; ".join(
            f"{s} {', '.join(str(int(v)) for v in column(s, 'rt_unfinished'))}" for s in POLICIES) + ".",
        "BROS's KV copies (lazy checkpoints of overwritten BE slots, restores) run on the PCIe link beside the "
        f"forwards, as the paper overlaps them: the link was busy {span(column(BROS, 'link_busy_s'), fmt='.1f')} s "
        f"per run, and forwards waited {span(column(BROS, 'forward_stall_s'), fmt='.2f')} s for the copies they "
        "read (a checkpoint of slots the step overwrites blocks it; a restore blocks the step that reads it).",
        "BROS's bidirectional memory (§5) per rate: overwrites (RT pages over BE slots) "
        f"{', '.join(str(int(v)) for v in column(BROS, 'overwrites'))}; checkpointed BE slots "
        f"{', '.join(str(int(v)) for v in column(BROS, 'checkpointed_slots'))}; restored pages "
        f"{', '.join(str(int(v)) for v in column(BROS, 'restored_pages'))}.",
        "Both length distributions are synthetic (sim/workloads.py).",
    ]


__all__ = ["BE_LENGTHS", "BROS", "be_batches", "FCFS", "POLICIES", "RR", "RT_LENGTHS", "SETUPS", "Setup", "VLLM", "VLLM_V0",
           "be_busy_seconds", "run"]
