"""KunServe's headline (kunserve.txt §5.1-§5.2, Figs. 12-13): P99 TTFT under BurstGPT's bursts,
KunServe (parameter drop + lookahead micro-batches) against vLLM (replicas, fcfs, recompute
preemption), vLLM (PP) (static two-stage pipelines), InferCept-like (replicas, preemption by
swap, copied layer by layer under the forward; `baselines.INFERCEPT`) and Llumnix-like
(replicas that migrate running requests live, `sim/migration.py`), Qwen2.5-14B on 8 instances of one
A100-80G each (the paper's cluster A: A800 80 GB, one GPU per server, 200 Gbps RDMA).
The paper: "KunServe has 12.7-72.2x faster P99 TTFT than other baselines".

The workload is fixed before any policy runs, and all five serve the same trace:
- lengths: §5.1's three datasets (`DATASETS`), synthetic, with their means: BurstGPT 642 in /
  262 out, ShareGPT 1,660 / 373 (inputs up to 4K), LongBench 5.9K / 499; each is a run of
  its own over the same arrivals' shape (the paper replays BurstGPT's arrivals with each);
- arrivals: `bursty_arrivals`, Poisson with bursts of 2-3x the base rate (§2.2) at the
  workload module's default timing (15 s bursts, Exp(60 s) apart);
- rate (§5.1): the paper scales the trace so that "the average memory demand is lower than 60%
  of the total memory during the entire evaluation". `rate_for_demand` applies that rule: it
  bisects the base rate per instance until one vLLM instance serving its share of the trace
  (the same bursts) has a KV demand averaging 60% of its KV capacity over the arrivals, and
  the cluster gets N times that rate. Demand is the blocks held plus every queued request's
  prompt blocks: §2.2's measure counts only the head of the queue, which would hide a queue
  waiting for compute and let the rule pick an overloaded rate.

Besides the five runs, the vLLM cluster runs once more with ten times the KV (nothing ever
throttles): the most any memory mechanism could take off vLLM's TTFT on this trace. The
notes explain the gaps to the paper with the runs' own numbers, and with `kunserve_regime`'s
arithmetic: what §2.2's numbers, and each of §5.1's datasets at the paper's KV demand, ask of
our GPU's compute.

Per dataset the result has the five runs, the ceiling run's share of vLLM's P99 that memory
explains, and Fig. 12's time series (KV demand against capacity, mean TTFT per window) for
`report.save_plots`.

`scale="ci"`: two instances, the trace up to 10 s after its second burst (about a thousand
requests), the rate chosen by the same rule on that trace; BurstGPT only.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cache, cached_property

from experiments import Comparison, ExperimentResult, check_scale
from experiments import kunserve_regime as regime
from experiments.baselines import INFERCEPT
from nanoserve.sim.cluster import ClusterConfig, simulate_cluster
from nanoserve.sim.hardware import gpu
from nanoserve.sim.metrics import Summary, downsample, summarize
from nanoserve.sim.migration import MigrationConfig
from nanoserve.sim.models import ModelCost, model
from nanoserve.sim.roofline import Roofline
from nanoserve.sim.simulation import SimConfig, SimResult, kv_blocks
from nanoserve.sim.workloads import (
    LENGTHS,
    BurstWindow,
    LengthDist,
    TraceRequest,
    burst_windows,
    bursty_arrivals,
    make_trace,
)

GPU, MODEL = "A100-80G", "Qwen2.5-14B"
LENGTH = LENGTHS["burstgpt"]
# §5.1's three datasets, served over BurstGPT's arrivals.
DATASETS = {"BurstGPT": LENGTHS["burstgpt"], "ShareGPT": LENGTHS["sharegpt-kunserve"],
            "LongBench": LENGTHS["longbench"]}
DEMAND_TARGET = 0.6  # §5.1: average memory demand lower than 60% of the total memory
BISECTION_STEPS = 7
PAPER_CLAIM = "12.7-72.2x lower"


@dataclass(frozen=True)
class Scale:
    num_instances: int
    duration: float  # seconds of trace
    bursts: int | None = None  # cut the trace TAIL seconds after this many bursts (None: keep all)
    restore_ablation: bool = False  # also run KunServe without restoration (§5.4, Fig. 15)


TAIL = 10.0
CEILING_KV_FACTOR = 10  # the ceiling run's KV, in replicas' worth
# InferCept's swap space per GPU. Assumption: KunServe states no CPU memory; InferCept's scripts
# give vLLM `--swap-space 64` (GiB per GPU) for its 13B model on two GPUs, 128 for 6B on one.
INFERCEPT_SWAP_GIB = 64
INFERCEPT_SWAP_TOKENS = INFERCEPT_SWAP_GIB * (1 << 30) // ModelCost(model(MODEL)).kv_bytes_per_token
# "long": §5.4's long run of BurstGPT (Fig. 15, "a long run (640s)"; §2.2 saw two throttling
# events on vLLM in it), BurstGPT only.
SCALES = {"paper": Scale(8, 240.0), "ci": Scale(2, 240.0, bursts=2),
          "long": Scale(8, 640.0, restore_ablation=True)}
NO_RESTORE = "KunServe w/o restore"


def configs(num_instances: int, restore_ablation: bool = False) -> dict[str, ClusterConfig]:
    def instance(policy: str) -> SimConfig:
        return SimConfig(policy=policy, gpu=GPU, model=MODEL)

    infercept = replace(INFERCEPT.sim_config(instance("fcfs")), host_kv_tokens=INFERCEPT_SWAP_TOKENS)
    return {
        "KunServe": ClusterConfig(instance("kunserve"), num_instances, drop=True),
        "vLLM (fcfs)": ClusterConfig(instance("fcfs"), num_instances),
        "vLLM-PP": ClusterConfig(instance("fcfs"), num_instances, static_pipeline_stages=2),
        "InferCept-like": ClusterConfig(infercept, num_instances),
        # §5.1: "Llumnix adopts load balancing ... and migrates KVCache between instances to free
        # sufficient memory": replicas, fcfs with recompute, and Llumnix v0.1.0's migration.
        "Llumnix-like": ClusterConfig(instance("fcfs"), num_instances, migration=MigrationConfig()),
        # §5.4: "without restoration, KunServe falls back to vLLM (PP)": groups stay pipelines.
        **({NO_RESTORE: ClusterConfig(instance("kunserve"), num_instances, drop=True, restore_fraction=-1.0)}
           if restore_ablation else {}),
    }


def workload(base_rate: float, scale: Scale, seed: int, lengths: LengthDist = LENGTH) -> list[TraceRequest]:
    """The trace at `base_rate` requests/s outside bursts, as long as the scale serves it."""
    duration = scale.duration
    windows = burst_windows(scale.duration, seed=seed)
    if scale.bursts is not None and len(windows) >= scale.bursts:  # else the whole trace
        duration = min(duration, windows[scale.bursts - 1].end + TAIL)
    return make_trace(bursty_arrivals(base_rate, duration=duration, seed=seed), lengths, seed=seed)


def kv_demand(rate_per_instance: float, scale: Scale, seed: int, lengths: LengthDist = LENGTH) -> float:
    """Time-averaged KV demand of one vLLM instance serving its share of the trace."""
    trace = workload(rate_per_instance, scale, seed, lengths)
    if not trace:
        return 0.0
    one = ClusterConfig(SimConfig(policy="fcfs", gpu=GPU, model=MODEL), num_instances=1)
    return simulate_cluster(one, trace).extra["kv_demand_mean"]


@cache
def rate_for_demand(scale: Scale, seed: int, target: float = DEMAND_TARGET,
                    lengths: LengthDist = LENGTH) -> tuple[float, tuple[tuple[float, float], ...]]:
    """The base rate per instance whose average KV demand over the trace `scale` serves is
    `target` (bisection, keeping the highest rate probed at or under it), and the probes
    (rate, demand). The upper bracket is the rate at which prefills alone fill the GPU."""
    roofline = Roofline(gpu(GPU), model(MODEL))
    lo, hi = 0.0, 1.0 / regime.prefill_seconds(roofline, lengths)
    probes = []
    for _ in range(BISECTION_STEPS):
        mid = (lo + hi) / 2
        probes.append((mid, kv_demand(mid, scale, seed, lengths)))
        lo, hi = (mid, hi) if probes[-1][1] <= target else (lo, mid)
    if lo == 0.0:
        raise RuntimeError(f"no probed rate kept the KV demand under {target:.0%}: {probes}")
    return lo, tuple(probes)


def kv_tokens_per_gpu() -> int:
    """One replica's KV, in tokens, as the simulator sizes it (what the weights leave)."""
    config = SimConfig(policy="fcfs", gpu=GPU, model=MODEL)
    return kv_blocks(config, Roofline(gpu(GPU), model(MODEL))) * config.block_size


def _ratio(base: float | None, ours: float | None) -> float:
    return float("nan") if base is None or not ours else base / ours


def unbounded_kv(config: ClusterConfig) -> ClusterConfig:
    """The same cluster with ten times the KV of a replica: nothing ever throttles, so its TTFT
    is what the same compute gives when memory never makes a request wait."""
    replica = kv_blocks(config.instance, Roofline(gpu(GPU), model(MODEL)))
    return replace(config, instance=replace(config.instance, kv_blocks=CEILING_KV_FACTOR * replica))


def dropped_seconds(changes: list[dict], end: float) -> float:
    """Instance-seconds spent in a pipeline group, from the layout changes' times and groups."""
    times = [c["time"] for c in changes] + [end]
    return sum(sum(len(g) for g in c["groups"]) * (t1 - c["time"]) for c, t1 in zip(changes, times[1:]))


# §5.1: "vLLM (release v0.6.3) ... By default, vLLM uses recomputation": fcfs over paged KV here
# (the FastGen-like baseline of experiments/baselines.py); vLLM-PP the same over PP=2.
PAPER_BASELINES = {"vLLM (fcfs)": "vLLM v0.6.3, recompute (Figs. 12-13; 12.7-72.2x is over vLLM, InferCept "
                                  "and Llumnix together)",
                   "vLLM-PP": "vLLM v0.6.3 with PP over two instances (Figs. 12-13)",
                   "InferCept-like": "InferCept on vLLM 0.2 with the paper's scheduler and attention backend (Figs. "
                                     "12-13; 12.7-72.2x is over vLLM, InferCept and Llumnix together)",
                   "Llumnix-like": "Llumnix v0.1.0 (Figs. 12-13; 12.7-72.2x is over vLLM, InferCept and Llumnix "
                                   "together)"}
TTFT_WINDOW_S = 10.0  # Fig. 12's second column: mean TTFT "given a measured time window"
TIMELINE_POINTS = 2000


@dataclass(frozen=True)
class DatasetRun:
    """One dataset's part of the experiment."""
    name: str
    seed: int
    rate: float  # base rate per instance, by §5.1's rule
    probes: tuple[tuple[float, float], ...]
    trace: list[TraceRequest]
    runs: dict[str, SimResult]
    ceiling: SimResult  # vLLM with ten times the KV

    @cached_property
    def stats(self) -> dict[str, Summary]:
        """Every run's summary over all requests."""
        return {label: summarize(result)["all"] for label, result in self.runs.items()}

    @cached_property
    def ceiling_stats(self) -> Summary:
        return summarize(self.ceiling)["all"]

    @cached_property
    def windows(self) -> list[BurstWindow]:
        """The trace's bursts."""
        return burst_windows(self.trace[-1].arrival, seed=self.seed)


def run_dataset(name: str, setup: Scale, seed: int) -> DatasetRun:
    lengths = DATASETS[name]
    rate, probes = rate_for_demand(setup, seed, lengths=lengths)
    trace = workload(rate * setup.num_instances, setup, seed, lengths)
    cluster = configs(setup.num_instances, setup.restore_ablation)
    runs = {label: simulate_cluster(config, trace) for label, config in cluster.items()}
    ceiling = simulate_cluster(unbounded_kv(cluster["vLLM (fcfs)"]), trace)
    return DatasetRun(name, seed, rate, probes, trace, runs, ceiling)


def memory_share(vllm_p99: float, ceiling_p99: float) -> float:
    """The share of vLLM's P99 TTFT that memory explains: what the ceiling run takes off it."""
    return 1.0 - ceiling_p99 / vllm_p99 if vllm_p99 > 0 else 0.0


def _comparisons(part: DatasetRun) -> list[Comparison]:
    stats, free = part.stats, part.ceiling_stats
    kun, name = stats["KunServe"], part.name
    comparisons = []
    for base in ("vLLM (fcfs)", "vLLM-PP", "InferCept-like", "Llumnix-like"):
        b = stats[base]
        comparisons += [
            Comparison(f"{name} P99 TTFT: {base} / KunServe", _ratio(b.ttft_p99, kun.ttft_p99), PAPER_CLAIM, 12.7,
                       PAPER_BASELINES[base]),
            Comparison(f"{name} P50 TTFT: {base} / KunServe", _ratio(b.ttft_p50, kun.ttft_p50),
                       "about equal (a little lower on LongBench)", None, PAPER_BASELINES[base]),
            # §5.2: KunServe's P50 TPOT is 15.8-22.7% higher (LongBench-14B): 1/1.227 at worst.
            Comparison(f"{name} P50 TPOT: {base} / KunServe", _ratio(b.tpot_p50, kun.tpot_p50),
                       "15.8-22.7% higher TPOT (LongBench-14B)", 1 / 1.227, PAPER_BASELINES[base]),
        ]
    # The ceiling: the most any memory mechanism could give vLLM. The paper's 12.7x over vLLM
    # needs at least 12.7x here (KunServe adds KV, not compute).
    comparisons.append(Comparison(
        f"{name} P99 TTFT: vLLM (fcfs) / vLLM with 10x KV (memory's part)", _ratio(stats["vLLM (fcfs)"].ttft_p99,
                                                                                  free.ttft_p99),
        "12.7x over vLLM needs memory to explain at least that much (Fig. 12: TTFT rises with KV demand)", 12.7,
        PAPER_BASELINES["vLLM (fcfs)"]))
    if NO_RESTORE in stats:  # §5.4 (Fig. 15): what restoring gives, over KunServe without it
        off = stats[NO_RESTORE]
        fig15 = "KunServe without restoration (Fig. 15, §5.4)"
        comparisons += [
            Comparison(f"{name} P99 TTFT: {NO_RESTORE} / KunServe", _ratio(off.ttft_p99, kun.ttft_p99),
                       "6.4x lower with restoration", 6.4, fig15),
            # "reduces the P50 latencies of TTFT and TPOT by 28% and 23%": 1/0.72 and 1/0.77.
            Comparison(f"{name} P50 TTFT: {NO_RESTORE} / KunServe", _ratio(off.ttft_p50, kun.ttft_p50),
                       "28% lower with restoration", 1 / 0.72, fig15),
            Comparison(f"{name} P50 TPOT: {NO_RESTORE} / KunServe", _ratio(off.tpot_p50, kun.tpot_p50),
                       "23% lower with restoration", 1 / 0.77, fig15),
        ]
    return comparisons


def timeline(part: DatasetRun) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """Fig. 12's first two columns for one dataset, from the first arrival: each run's KV demand
    over its KV capacity at the time (KunServe's grows with a drop; the ceiling run's over one
    replica's, so it shows what the others would have needed), and its mean TTFT per
    `TTFT_WINDOW_S` window of arrivals."""
    start = part.trace[0].arrival if part.trace else 0.0
    demand, ttft = {}, {}
    for label, result in {**part.runs, "vLLM, 10x KV": part.ceiling}.items():
        scale = CEILING_KV_FACTOR if result is part.ceiling else 1
        demand[label] = [(t - start, d * scale) for t, d in downsample(result.extra["kv_demand_series"],
                                                                      TIMELINE_POINTS)]
        windows: dict[int, list[float]] = {}
        for r in result.records:
            if r.ttft is not None:
                windows.setdefault(int((r.arrival - start) // TTFT_WINDOW_S), []).append(r.ttft)
        ttft[label] = [((w + 0.5) * TTFT_WINDOW_S, sum(v) / len(v)) for w, v in sorted(windows.items())]
    return {"kv_demand": demand, "ttft_mean": ttft}


def run(scale: str = "paper", seed: int = 0, datasets: Sequence[str] | None = None) -> ExperimentResult:
    """Every dataset of `DATASETS` at paper scale (`datasets` picks some), BurstGPT at ci and long."""
    check_scale(scale, "kunserve")
    setup = SCALES[scale]
    names = list(datasets or (DATASETS if scale == "paper" else ("BurstGPT",)))
    parts = [run_dataset(name, setup, seed) for name in names]
    runs = {f"{part.name}: {label}": result for part in parts for label, result in part.runs.items()}
    notes = [f"{part.name}. {line}" for part in parts for line in _notes(setup, part)]
    roofline = Roofline(gpu(GPU), model(MODEL))
    notes += [MODEL_NOTE] + regime.lines(roofline, f"{MODEL} on {GPU}", kv_tokens_per_gpu(), DATASETS, LENGTH)
    return ExperimentResult(
        name="kunserve",
        title=f"KunServe vs vLLM and vLLM (PP): {MODEL}, {setup.num_instances} x {GPU}, BurstGPT-like bursts",
        workload="; ".join(f"{DATASETS[p.name].label}: {len(p.trace)} requests over {p.trace[-1].arrival:.0f} s"
                           for p in parts) + "; bursty Poisson arrivals (x2-3 bursts)",
        runs=runs, comparisons=[c for part in parts for c in _comparisons(part)], notes=notes,
        extra={"datasets": {part.name: _extra(part) for part in parts},
               "timeline": {part.name: timeline(part) for part in parts}},
    )


def _extra(part: DatasetRun) -> dict:
    free = part.ceiling_stats
    return {"rate_per_instance": part.rate, "rate_probes": part.probes,
            "bursts": [(w.start, w.end, w.factor) for w in part.windows],
            "layout_changes": part.runs["KunServe"].extra["layout_changes"],
            "unbounded_kv_vllm": {"ttft_p50": free.ttft_p50, "ttft_p99": free.ttft_p99, "tpot_p50": free.tpot_p50}}


def _notes(setup: Scale, part: DatasetRun) -> list[str]:
    """Why the results differ from the paper, each point with this run's own numbers."""
    rate, num_probes, trace, runs, windows = part.rate, len(part.probes), part.trace, part.runs, part.windows
    free = part.ceiling_stats
    vllm, pp = part.stats["vLLM (fcfs)"], part.stats["vLLM-PP"]
    kun_run = runs["KunServe"]
    changes = kun_run.extra["layout_changes"]
    dropped = {i for c in changes for g in c["groups"] for i in g}
    drops = [c for c in changes if c["kind"] == "drop"]
    growth = drops[0]["capacity_after"] / drops[0]["capacity_before"] if drops else 1.0
    roofline = Roofline(gpu(GPU), model(MODEL))
    prefill_bound = 1.0 / regime.prefill_seconds(roofline, DATASETS[part.name])
    kv_tokens = kv_tokens_per_gpu()
    factors = [w.factor for w in windows] or [1.0]
    burst = (rate * min(factors), rate * max(factors))
    return [
        f"Rate by §5.1's rule: {rate:.2f} req/s per instance outside bursts ({rate * setup.num_instances:.1f} for "
        f"the cluster), the highest of {num_probes} bisection probes at which one vLLM instance's KV demand "
        f"averaged at most {DEMAND_TARGET:.0%} over the arrivals (every queued prompt counted, see the module).",
        f"Bursts bring {burst[0]:.1f}-{burst[1]:.1f} req/s per instance, whose prefills alone take "
        f"{burst[0] / prefill_bound:.0%}-{burst[1] / prefill_bound:.0%} of an A100 (roofline), decodes on top. "
        f"vLLM with ten times the KV (nothing throttles, same max_num_seqs) has a P99 TTFT of "
        f"{free.ttft_p99:.2f} s against {vllm.ttft_p99:.2f} s with its real KV ({kv_tokens / 1e3:.0f}K tokens "
        f"per instance): memory explains {memory_share(vllm.ttft_p99, free.ttft_p99):.0%} of vLLM's P99 "
        f"({_ratio(vllm.ttft_p99, free.ttft_p99):.2f}x), the most any memory mechanism could take off it; the "
        "paper's 12.7x over vLLM needs at least 92%.",
        f"KunServe: {kun_run.events['drops']} drop(s), {kun_run.events['restores']} restore(s) "
        f"({dropped_seconds(changes, trace[0].arrival + kun_run.duration):.0f} instance-seconds in pipelines), "
        f"{kun_run.events['requeued']} queued requests re-dispatched after a drop, "
        f"{kun_run.extra['kv_exchange_bytes'] / 1e9:.0f} GB of KV exchanged and "
        f"{kun_run.extra['weight_pull_bytes'] / 1e9:.0f} GB of weights pulled back over the network. A drop adds "
        "KV, not compute: a pair's micro-batches (a step of at least 2 x MIN tokens is cut) each re-read a "
        "stage's weights and members' batches of unequal cost idle a stage, yet the dispatcher, which balances "
        "KV demand, sends each member more (its pool is "
        f"{growth:.2f}x a replica's), and the pair restores only once its demand is under 50%.",
        "The largest share of the slowest 1% on one instance: " + ", ".join(
            f"{k} {r.extra['tail_on_one_instance']:.0%}" for k, r in runs.items())
        + f" (KunServe's was {'a dropped' if kun_run.extra['tail_instance'] in dropped else 'a never-dropped'} "
        "instance). The dispatcher balances Llumnix's virtual usage (KV held plus every queued request's), so "
        "a queue waiting for compute or max_num_seqs room counts against its instance; the monitor still "
        "throttles on the head of the queue only (§2.2).",
        f"vLLM-PP: TPOT p50 {_ratio(pp.tpot_p50, vllm.tpot_p50):.1f}x vLLM's and P99 TTFT "
        f"{_ratio(pp.ttft_p99, vllm.ttft_p99):.1f}x: each member's batch is one micro-batch (vLLM's virtual "
        "engines), 2048-token chunked-prefill steps alternate with decode-only ones, and a stage idles while "
        "the other runs a long one (Fig. 8's bubbles); under a compute-bound burst the lost throughput turns "
        "into queueing (the paper measured 3.3-21.8% lower throughput).",
    ]


MODEL_NOTE = ("Modelled coarsely: KV exchange and weight pulls run at the link's rate (the paper's chunking and "
              "priority for activations are assumed perfect), a restoring instance waits for its weights (the paper "
              "overlaps the pull with serving), one layout change at a time, and remapping costs nothing.")


def regime_report() -> str:
    """kunserve_regime's arithmetic for this experiment's GPU, model and three datasets."""
    roof = Roofline(gpu(GPU), model(MODEL))
    return "\n".join(regime.lines(roof, f"{MODEL} on {GPU}", kv_tokens_per_gpu(), DATASETS, LENGTHS["burstgpt"]))


if __name__ == "__main__":
    print(regime_report())
