"""ConServe's headline comparison (conserve.txt §6.1-6.2, with §6.3.2's Gamma load generator),
re-run in the simulator: Llama-2-7B on one A100-40G serving bursty online requests beside a
LongBench-like offline pool, under ConServe (sched/conserve.py over memory/checkpoint_kv.py,
with layer-wise preemption in the simulator's executor) and the paper's baselines
(sim/experiments/baselines.py): vLLM++ as §3 and §6.1 define it (priority queue, chunked
prefill, running offline requests never preempted selectively, swapping under memory pressure:
sched/priority_nonselective.py over memory/swap.py) and Online-Only (fcfs fed only the online
requests). Two more rows: vLLM++ with recompute instead of swap (vLLM 0.4.2's default for one
sequence, swept as the assumption it is) and our stronger vLLM++ (selective, recompute:
sched/priority.py, which preempts offline work the moment an online request needs room).

The paper: 2.35x the overall throughput of Online-Only, and 84x lower online P99 TTFT (25x
lower P99 TPOT) than vLLM++, with online latency close to Online-Only's.

The workload, fixed here before any policy runs, from the paper's setup:
- SLOs: TTFT 1.5 s, TPOT 110 ms (§6.2, Online-Only's P99 on the paper's trace).
- Online arrivals: a Gamma process (ConServe's own load generator, §5) at 2 requests/s (§6.3.2)
  for 900 s (the 15-minute BurstGPT window of Fig. 1b / Fig. 5), at CV 1, 2 and 4 (Fig. 7
  sweeps burstiness; every CV is reported, none is singled out). The lengths are BurstGPT's
  (§6.2's online dataset; KunServe's averages, 642 in / 262 out), kept inside Llama-2's 4K
  context (prompt <= 3,584, output <= 512) with the means preserved.
- Offline: LongBench-like summarization (§6.1), truncated as LongBench truncates prompts for
  4K-context Llama-2 models (3,500 tokens, middle cut) with its summarization generation cap
  (512), submitted at t = 0 as one pool (ConServe's batch API, §4.1). The pool is sized by an
  analytic bound, not by any run: no policy could finish it within the online window.

Throughput is measured over the online window [0, duration] (the paper's Fig. 5 averages over
its trace), as output tokens (the paper's stated metric, §6.1) and as processed tokens (prompt +
output), which is what the paper's absolute numbers match (see the notes). Every run then
drains: every request finishes. P99 TPOT is reported per request (nanoserve's SLO metric) and
per token (the paper's, §2.2 footnote 2). KV copies run on the link beside the forwards, as on
the runner's copy stream (sim/executor.py): each run reports how long the link was busy and how
long forwards stalled on the copies they read.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from nanoserve.sim.experiments import Comparison, ExperimentResult, check_scale
from nanoserve.sim.experiments import baselines
from nanoserve.sim.hardware import gpu
from nanoserve.sim.metrics import percentile, summarize
from nanoserve.sim.models import model
from nanoserve.sim.roofline import Roofline
from nanoserve.sim.simulation import SimConfig, SimResult, kv_blocks, simulate
from nanoserve.sim.workloads import (LENGTHS, LengthDist, TraceRequest, clipped_lognormal_mean, gamma_arrivals,
                                     make_trace, merge_traces, solve_mu)
from nanoserve.slo import SLO


@dataclass(frozen=True)
class Setup:
    gpu: str = "A100-40G"  # §6.1
    model: str = "Llama-2-7B"
    slo: SLO = SLO(ttft=1.5, tpot=0.110)  # §6.2
    online_rate: float = 2.0  # requests/s, §6.3.2
    cvs: tuple[float, ...] = (1.0, 2.0, 4.0)  # the range of burstiness (Fig. 7 sweeps CV)
    duration: float = 900.0  # seconds of online arrivals: Fig. 5's 15-minute trace
    offline_max_prompt: int = 3500  # LongBench's truncation for 4K-context Llama-2 models
    offline_max_output: int = 512  # LongBench's generation cap for summarization


# ci: the same setup on ~180 online and ~140 offline requests, at the middle CV.
SETUPS = {"paper": Setup(), "ci": Setup(cvs=(2.0,), duration=90.0)}
ONLINE_LENGTHS = LengthDist("BurstGPT-like (KunServe's averages) within a 4K context", 642, 262,
                            max_prompt=3584, max_output=512)
OFFLINE_LENGTHS = LENGTHS["longbench"]
CONSERVE = "ConServe"
ONLINE_ONLY, VLLMPP = baselines.ONLINE_ONLY.label, baselines.VLLM_PP_CONSERVE.label
VLLMPP_RECOMPUTE, VLLMPP_SELECTIVE = baselines.VLLM_PP_CONSERVE_RECOMPUTE.label, baselines.VLLM_PP_SELECTIVE.label
BASELINES = (baselines.ONLINE_ONLY, baselines.VLLM_PP_CONSERVE, baselines.VLLM_PP_CONSERVE_RECOMPUTE,
             baselines.VLLM_PP_SELECTIVE)
FIGURE = "ConServe Fig. 5 (§6.2)"


def _clipped_mean(mean: float, sigma: float, lo: float, hi: float, cap: float) -> float:
    """Mean of min(X, cap) for X the LengthDist lognormal clipped to [lo, hi]."""
    return clipped_lognormal_mean(solve_mu(mean, sigma, lo, hi), sigma, lo, min(hi, cap))


def offline_pool_size(setup: Setup) -> int:
    """More offline requests than any policy could finish within the online window: as many
    offline requests as the KV holds at their smallest footprint (the prompt alone), decoding
    together in steps that read only the weights and those prompts' K/V (no prefill, no online
    work, no growth), for the whole window."""
    roofline = Roofline(gpu(setup.gpu), model(setup.model))
    config = SimConfig(gpu=setup.gpu, model=setup.model)
    kv_tokens = kv_blocks(config, roofline) * config.block_size
    d = OFFLINE_LENGTHS
    prompt = _clipped_mean(d.mean_prompt, d.sigma, d.min_prompt, d.max_prompt, setup.offline_max_prompt)
    output = _clipped_mean(d.mean_output, d.sigma, d.min_output, d.max_output, setup.offline_max_output)
    running = max(1, int(kv_tokens // prompt))
    step = roofline.iteration_seconds([(int(prompt), 1)] * running)
    return math.ceil(running / (output * step) * setup.duration)


def offline_pool(setup: Setup, seed: int) -> list[TraceRequest]:
    pairs = OFFLINE_LENGTHS.sample(offline_pool_size(setup), seed)
    return [TraceRequest(0.0, min(p, setup.offline_max_prompt), min(o, setup.offline_max_output), "offline")
            for p, o in pairs]


def online_trace(setup: Setup, cv: float, seed: int) -> list[TraceRequest]:
    return make_trace(gamma_arrivals(setup.online_rate, cv, duration=setup.duration, seed=seed),
                      ONLINE_LENGTHS, seed=seed + 1)


def window_stats(result: SimResult, window: float) -> dict[str, float]:
    """What a run did within the online window, and its online latencies (seconds, tokens/s)."""
    online = summarize(result)["online"]
    output = result.tokens_by(window)
    prefilled = sum(r.prompt_len for r in result.records if r.ttft is not None and r.arrival + r.ttft <= window)
    gaps = result.online_token_gaps
    return {
        "output_tok_s": output / window,
        "online_output_tok_s": result.tokens_by(window, online_only=True) / window,
        "processed_tok_s": (output + prefilled) / window,
        "online_ttft_p99": online.ttft_p99,
        "online_tpot_p99": online.tpot_p99,
        "online_token_tpot_p99": percentile(gaps, 99) if gaps else math.nan,
        "online_slo_attainment": online.slo_attainment,
        "layerwise_preemptions": result.extra["layerwise_preemptions"],
        "swap_outs": result.events.get("swap_outs", 0),
        "link_busy_seconds": result.link_busy_seconds,
        "forward_stall_seconds": result.forward_stall_seconds,
        "offline_left_at_window": sum(1 for r in result.records if r.priority == "offline"
                                      and r.arrival + r.e2e > window),
    }


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.inf


def run(scale: str = "paper", seed: int = 0) -> ExperimentResult:
    check_scale(scale)
    setup = SETUPS[scale]
    pool = offline_pool(setup, seed + 2)
    base = SimConfig(gpu=setup.gpu, model=setup.model, online_slo=setup.slo, record_online_token_gaps=True, host_kv_tokens=500_000)
    configs = {**{b.label: b.sim_config(base) for b in BASELINES}, CONSERVE: replace(base, policy="conserve")}
    runs: dict[str, SimResult] = {}
    table: dict[str, dict[str, float]] = {}
    comparisons: list[Comparison] = []
    for cv in setup.cvs:
        online = online_trace(setup, cv, seed)
        mixed = merge_traces(online, pool)
        stats = {}
        for label, config in configs.items():
            result = simulate(config, online if label == ONLINE_ONLY else mixed)
            runs[f"{label}, CV={cv:g}"] = result
            stats[label] = table[f"{label}, CV={cv:g}"] = window_stats(result, setup.duration)
        cs, oo = stats[CONSERVE], stats[ONLINE_ONLY]
        at = f" (CV={cv:g})"
        online_only = f"Online-Only: vLLM fed the online requests alone ({FIGURE})"
        comparisons += [
            Comparison("total output throughput in the window: ConServe / Online-Only" + at,
                       _ratio(cs["output_tok_s"], oo["output_tok_s"]),
                       "2.35x higher (its Fig. 5 numbers: 3702 / 1999 = 1.85x)", 2.35, online_only),
            Comparison("total processed (prompt + output) throughput: ConServe / Online-Only" + at,
                       _ratio(cs["processed_tok_s"], oo["processed_tok_s"]), "2.35x higher", 2.35, online_only),
        ]
        for label in (VLLMPP, VLLMPP_RECOMPUTE, VLLMPP_SELECTIVE):
            pp, ran = stats[label], label == VLLMPP
            paper = "vLLM++: vLLM 0.4.2, priority queue, chunked prefill, \"frequent swapping\" (" + FIGURE + ")"
            comparisons += [
                Comparison(f"online P99 TTFT: {label} / ConServe" + at,
                           _ratio(pp["online_ttft_p99"], cs["online_ttft_p99"]),
                           "84x lower (83,825 ms for vLLM++)" if ran else "(not run by the paper)",
                           84.0 if ran else None, paper if ran else "none"),
                Comparison(f"online P99 per-token TPOT: {label} / ConServe" + at,
                           _ratio(pp["online_token_tpot_p99"], cs["online_token_tpot_p99"]),
                           "25x lower (2,523 ms for vLLM++)" if ran else "(not run by the paper)",
                           25.0 if ran else None, paper if ran else "none"),
            ]
        comparisons.append(Comparison("online P99 TTFT: Online-Only / ConServe" + at,
                                      _ratio(oo["online_ttft_p99"], cs["online_ttft_p99"]),
                                      "close to Online-Only (within 25%, §6.3.2)", 1 / 1.25,
                                      "Online-Only (§6.3.2, Fig. 7)"))
    return ExperimentResult(
        name="conserve",
        title=(f"ConServe vs Online-Only and vLLM++ (conserve.txt §6.2): {setup.model} on one {setup.gpu}, "
               f"online Gamma {setup.online_rate:g} req/s at CV {', '.join(f'{c:g}' for c in setup.cvs)} for "
               f"{setup.duration:g} s beside a pool of {len(pool)} offline requests; SLO TTFT "
               f"{setup.slo.ttft * 1e3:g} ms / TPOT {setup.slo.tpot * 1e3:g} ms"),
        workload=f"online: {ONLINE_LENGTHS.label}; offline: {OFFLINE_LENGTHS.label}, truncated to "
                 f"{setup.offline_max_prompt} prompt / {setup.offline_max_output} output tokens",
        runs=runs, comparisons=comparisons, notes=notes(table, setup),
        # "policies": a table the report prints (in the window: tok/s; latencies in seconds).
        extra={"policies": [{"run": label, **row} for label, row in table.items()]},
    )


def notes(table: dict[str, dict[str, float]], setup: Setup) -> list[str]:
    def rows(label: str) -> list[dict[str, float]]:
        return [table[f"{label}, CV={cv:g}"] for cv in setup.cvs]

    def column(label: str, key: str) -> list[float]:
        return [row[key] for row in rows(label)]

    def span(values: list[float], scale: float = 1.0, fmt: str = ".0f") -> str:
        lo, hi = min(values) * scale, max(values) * scale
        return f"{lo:{fmt}}" if f"{lo:{fmt}}" == f"{hi:{fmt}}" else f"{lo:{fmt}}-{hi:{fmt}}"

    def wins(label: str) -> int:
        return sum(c < p for c, p in zip(column(CONSERVE, "online_ttft_p99"), column(label, "online_ttft_p99")))

    def tpot_ratio(label: str) -> str:
        return span([p / c for p, c in zip(column(label, "online_token_tpot_p99"),
                                           column(CONSERVE, "online_token_tpot_p99"))], fmt=".2f")

    link = [c / setup.duration for c in column(CONSERVE, "link_busy_seconds")]
    stall = [c / setup.duration for c in column(CONSERVE, "forward_stall_seconds")]
    overloaded = [f"{t:.1f} s at CV {cv:g}" for cv, t in zip(setup.cvs, column(ONLINE_ONLY, "online_ttft_p99"))
                  if t > setup.slo.ttft]
    harvest = [c - o for c, o in zip(column(CONSERVE, "processed_tok_s"), column(ONLINE_ONLY, "processed_tok_s"))]
    return [
        f"{VLLMPP} is the paper's vLLM++: running offline requests are never preempted for an online arrival "
        "(§3: they \"cannot be pre-empted selectively\"), only memory pressure swaps the newest running "
        "request, lowest priority first, whole, blocking the step both ways (§6.2: \"frequent swapping\"). "
        f"ConServe's online P99 TTFT beat it at {wins(VLLMPP)} of {len(setup.cvs)} CVs; its per-token P99 TPOT "
        f"ratio (vLLM++ / ConServe) is {tpot_ratio(VLLMPP)}. With recompute instead of swap (vLLM 0.4.2's "
        f"default for one sequence; the assumption swept): {wins(VLLMPP_RECOMPUTE)} of {len(setup.cvs)} and "
        f"{tpot_ratio(VLLMPP_RECOMPUTE)}. Ours, {VLLMPP_SELECTIVE}, preempts offline work the moment an online "
        f"request needs room: {wins(VLLMPP_SELECTIVE)} of {len(setup.cvs)} and {tpot_ratio(VLLMPP_SELECTIVE)}. "
        "Swap-outs per CV, vLLM++: " + ", ".join(str(int(v)) for v in column(VLLMPP, "swap_outs")) + ".",
        "nanoserve's runner issues KV copies on a copy stream beside the forward, and the simulator prices "
        "them on a link of their own: a forward waits only for the copies it reads. Nobody waits for "
        "ConServe's checkpoint saves; a resumed request's loads are issued in the step that resumes it "
        "(nanoserve's checkpointer prefetches only there), so that step waits for them, and for whatever "
        "saves are ahead of them on the one link. "
        f"The link carried ConServe's copies for {span(link, 100, '.1f')}% of the window's length (over the whole "
        f"run, the drain included), and forwards stalled on them for {span(stall, 100, '.1f')}%. The stalls "
        "come from where the loads sit: ConServe resumes preempted offline requests as soon as memory frees, "
        "loading each whole checkpoint (a 3.5K-token request: ~1.8 GB, ~70 ms over PCIe) in the step that "
        "runs it, and the next online arrival preempts them again; those loads are neither held to the SLO "
        "budget (§4.5 defers swap-in blocks the SLO cannot afford) nor issued ahead of that step and split "
        "over several (§4.4's background prefetch).",
        "Throughput: the paper counts generated tokens (§6.1), but its Fig. 5 numbers fit processed tokens: "
        "Online-Only's 1,999 tok/s is what ~2 req/s of BurstGPT-sized requests (904 tokens each) process, "
        "not what they generate (~524 tok/s); and its 2.35x is not its own 3,702 / 1,999 = 1.85x. Both "
        f"readings are reported. ConServe harvested {span(harvest)} processed tok/s of offline work (the "
        "paper's Fig. 5: 1,703); in output tokens the gain is small because a LongBench request is mostly "
        f"prompt and holds ~2 GB of KV, of the ~20 GB an {setup.gpu} leaves for KV: the harvest is KV-bound.",
        "Layer-wise preemption fires only in a pure-offline batch (no online request anywhere) and only when "
        "waiting for it would miss the TTFT. At 2 online req/s some online request is almost always in the "
        "system, and a 2,048-token forward takes ~0.2 s against a 1.5 s target, so it fired "
        f"{span(column(CONSERVE, 'layerwise_preemptions'))} times per run. Safe points cost nothing in the "
        "simulator (the paper measured 988 us each, mostly a tensor-parallel barrier; tp = 1 here).",
        *([f"The online load alone overflows the GPU in bursts (Online-Only's P99 TTFT: {', '.join(overloaded)}), "
           "so no policy can meet the TTFT SLO there; the paper set its rate to the most Online-Only sustains "
           "within the SLOs."] if overloaded else []),
        "Online arrivals are a Gamma process standing in for the BurstGPT trace, and both length "
        "distributions are synthetic (sim/workloads.py); the SLOs are the paper's (set from its Online-Only "
        "P99s), taken as given.",
    ]
