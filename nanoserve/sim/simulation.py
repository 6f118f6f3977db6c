"""One simulated serving run: a trace into a real `Engine` (the policy's scheduler, its KV
manager, the engine's bookkeeping) whose executor is a `SimExecutor` on a virtual clock.

    for each step:   admit every trace request that has arrived by now (at its arrival time),
                     and the next closed-loop batch if the one before it has completed
                     nothing to run?  jump the clock to the next arrival
                     engine.step()    the policy schedules (its KV manager first polls which
                                      copies landed), the executor queues the step's copies on
                                      the link and advances the clock by the forward and by
                                      whatever it had to wait for of the copies it reads
                     no forward?      jump the clock to the next arrival or the next copy landing,
                                      whichever comes first (a manager may be waiting for a save
                                      to land before it can resume a request)
                     record finished requests, KV usage and tokens generated so far

Copies overlap the forwards, as on the real runner's copy stream; sim/executor.py draws the
link's timeline beside the forward's. The link is one more resource with its own clock, so a run
reports two numbers for it: `link_busy_seconds` (how long the link carried copies) and
`forward_stall_seconds` (how long forwards waited for the copies they read).

Mid-forward arrivals (ConServe's Alg. 2 runs "on arrival", conserve.txt §4.2-4.3): for a policy
that can ask to stop the forward in flight (`Scheduler.PREEMPTS_RUNNING_BATCH`, as the server's
`AsyncEngine` decides), the loop's admission also runs at the executor's safe points
(`PreemptionFlag.on_safe_point`), with the clock at that layer boundary; other policies see an
arrival when the step ends, as before.

KV capacity is what the named GPU leaves after the weights (`gpu_memory_utilization` of its
memory, minus this GPU's share of the weights and an activation reserve), or `kv_bytes` when an
experiment fixes it (EcoServe's 12 GB). Host stores for the managers that need one keep only
their bookkeeping (no tensors: a store built with zero layers); the manager and the executor
share it, the executor filing copies in its ledger and the manager polling it.

As the real engine does, the sim's engine calibrates the policy's cost model against measured
step times (`calibrate_cost_model`), measured on the scheduler's clock, which here is the virtual
clock: time-budgeting policies learn the roofline's real step cost (for Llama-2-7B on an
A100-80G the fitted profile predicts a 2,048-token prefill at ~128 ms where the roofline charges
~150 ms), stalls for copies included.
"""
from __future__ import annotations

import bisect
import math
import os
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from nanoserve.config import EngineArgs, ModelConfig, SchedulerConfig
from nanoserve.engine import Engine
from nanoserve.memory import NEEDS_HOST_STORE, KVBuildContext, make_kv_manager
from nanoserve.memory.host import HostKVStore
from nanoserve.outputs import RequestOutput
from nanoserve.sampling import SamplingParams
from nanoserve.sched import POLICY_MEMORY, make_scheduler, scheduler_class
from nanoserve.sched.cost_model import CostModel
from nanoserve.sim.executor import EOS_TOKEN, FILLER_TOKEN, SimExecutor, VirtualClock
from nanoserve.sim.hardware import Efficiency, gpu
from nanoserve.sim.models import ModelCost, model
from nanoserve.sim.roofline import Roofline, fitted_cost_model
from nanoserve.sim.workloads import ClosedLoopBatches, TraceRequest, prompt_token_ids
from nanoserve.slo import DEFAULT_SLOS, SLO, RequestClass

ACTIVATION_RESERVE = 2e9  # bytes kept free for activations, as the real builder keeps 1 GiB
# Copies-only steps in a row at one instant with nothing left on the link, before the simulation
# gives up: a policy that keeps issuing copies without ever running a forward makes no progress.
MAX_IDLE_STEPS = 8


@dataclass(frozen=True)
class SimConfig:
    policy: str = EngineArgs.policy
    gpu: str = "A100-80G"
    # The named GPU's achieved fractions and overheads replaced (sim/hardware.py's Efficiency):
    # benchmarks/sim_fidelity.py prices nanoserve's own engine on a GPU it measured.
    efficiency: Efficiency | None = None
    model: str = "Llama-2-7B"
    tp: int = 1
    kv_manager: str | None = None  # default: the policy's (sched.POLICY_MEMORY)
    kv_manager_options: Mapping[str, Any] | None = None
    # Automatic prefix caching (EngineArgs.enable_prefix_caching). Off here, unlike the engine's
    # default: every paper's vLLM baseline (vLLM 0.2-0.5) ran without it, and the experiments
    # reproduce those runs. On: the managers that support it share prefixes, as the engine's do.
    enable_prefix_caching: bool = False
    prefix_cache_host_tokens: int = 0  # EngineArgs': the prefix cache's host tier (paged only)
    policy_options: Mapping[str, Any] | None = None  # the policy's knobs (Scheduler.OPTIONS)
    kv_bytes: float | None = None  # KV memory per GPU; default: what the weights leave
    host_kv_tokens: int | None = None  # default: as many as the device holds
    gpu_memory_utilization: float = EngineArgs.gpu_memory_utilization
    block_size: int = EngineArgs.block_size
    max_num_batched_tokens: int = EngineArgs.max_num_batched_tokens
    max_num_seqs: int = 256  # ours, for the papers' GPUs (the engine's default, 128, is for one small device)
    max_model_len: int | None = None  # default: the model's
    online_slo: SLO = DEFAULT_SLOS[RequestClass.ONLINE]
    offline_slo: SLO = DEFAULT_SLOS[RequestClass.OFFLINE]
    fitted_policy_model: bool = True  # policies budget with a profile of the simulated GPU
    preempt_every_layers: int = EngineArgs.preempt_every_layers  # ConServe §4.3's safe-point spacing
    layerwise_copies: bool = False  # EngineArgs.layerwise_kv_copies: copies stream layer by layer
    # Scale the policy's cost model by the measured (virtual) step times, as the real engine does.
    # NANOSERVE_SIM_CALIBRATE=0 turns it off for a whole experiment (an ablation switch).
    calibrate_cost_model: bool = field(default_factory=lambda: os.environ.get("NANOSERVE_SIM_CALIBRATE") != "0")
    record_online_token_gaps: bool = False  # SimResult.online_token_gaps: per-token TPOT samples
    # A model outside sim/models.py (e.g. SmolLM2 read from its config.json, for sim_fidelity)
    # and a fixed number of KV blocks (the real engine's), both overriding the names above.
    model_config: ModelConfig | None = None
    kv_blocks: int | None = None
    # The host's scheduling time. None: every step pays the GPU's flat `iteration_overhead_s`
    # whatever the policy (sim/hardware.py), so no policy's scheduling costs more than another's. A
    # factor: each step also pays the wall time its scheduler took to plan it on this machine,
    # times the factor (the target host's CPU time per unit of ours: 1.0 assumes it is as fast),
    # in series with the forward; `SimResult.extra["scheduling_seconds"]` sums it. Measured time varies
    # from run to run, so such runs are not bit-for-bit repeatable.
    scheduling_time_scale: float | None = None
    # Stop this many virtual seconds after the first arrival, even with work left: a policy that
    # falls into overload may take hours to drain. Unfinished requests get records with
    # finish_reason None, e2e None and the TTFT they got (if any); SimResult.unfinished counts them.
    horizon: float | None = None


@dataclass(frozen=True)
class RequestRecord:
    request_id: str
    priority: RequestClass
    arrival: float
    prompt_len: int
    output_len: int
    ttft: float | None
    tpot: float | None
    e2e: float | None
    preemptions: int
    finish_reason: str | None

    def __post_init__(self) -> None:
        object.__setattr__(self, "priority", RequestClass(self.priority))  # "online"/"offline" too


@dataclass
class SimResult:
    config: SimConfig
    records: list[RequestRecord]
    kv_usage: list[tuple[float, float]]  # (time, used / total blocks), after each step
    events: dict[str, int]  # the KV manager's counters (preemptions, checkpoints, ...)
    steps: int
    busy_seconds: float
    link_busy_seconds: float  # seconds the device-host link carried KV copies (never two at once)
    # Seconds forwards waited for the copies they read (this step's blocking copies, loads of
    # the batch's requests): the part of the link's time that lengthened steps.
    forward_stall_seconds: float
    duration: float  # virtual seconds from the first arrival to the last finish
    extra: dict[str, Any] = field(default_factory=dict)
    # (time, output tokens generated so far: all, online), after each step that generated any:
    # throughput over a window (`tokens_by`), where a record only knows when a request finished.
    generated: list[tuple[float, int, int]] = field(default_factory=list)
    # Every gap between consecutive tokens of online requests (`record_online_token_gaps`):
    # ConServe's TPOT is per token (§2.2, footnote 2), where RequestRecord.tpot is a request's mean.
    online_token_gaps: list[float] = field(default_factory=list)

    @property
    def unfinished(self) -> int:
        """Requests still in the system when `SimConfig.horizon` stopped the run."""
        return sum(r.e2e is None for r in self.records)

    @property
    def end(self) -> float:
        """Virtual time at which the run ended."""
        return min((r.arrival for r in self.records), default=0.0) + self.duration

    def waited(self, record: RequestRecord) -> float:
        """A request's end-to-end latency; for one the horizon cut off, the time it had waited by
        the end (a lower bound, so a policy that falls behind cannot look better by leaving work
        unfinished). One that had not yet arrived has waited 0."""
        return record.e2e if record.e2e is not None else max(0.0, self.end - record.arrival)

    def tokens_by(self, when: float, online_only: bool = False) -> int:
        """Output tokens generated by virtual time `when` (the last step ending at or before it)."""
        at = bisect.bisect_right(self.generated, (when, math.inf))
        if not at:
            return 0
        _, total, online = self.generated[at - 1]
        return online if online_only else total


def kv_blocks(config: SimConfig, roofline: Roofline) -> int:
    if config.kv_blocks is not None:
        return config.kv_blocks
    cost = ModelCost(roofline.model)
    if config.kv_bytes is not None:
        budget = config.kv_bytes
    else:
        device = roofline.gpu.memory_bytes * config.gpu_memory_utilization
        budget = device - cost.weight_bytes / config.tp - ACTIVATION_RESERVE
    per_block = cost.kv_bytes_per_token * config.block_size / config.tp
    blocks = int(budget // per_block)
    if blocks < 1:
        raise ValueError(f"{config.model} leaves no KV memory on {config.gpu} at tp={config.tp}")
    return blocks


def build(config: SimConfig, output_lens: Mapping[str, int], clock: VirtualClock,
          executor_cost: Roofline | CostModel | None = None) -> tuple[Engine, SimExecutor, Roofline]:
    device = gpu(config.gpu) if config.efficiency is None else replace(gpu(config.gpu), efficiency=config.efficiency)
    roofline = Roofline(device, config.model_config or model(config.model), config.tp)
    num_blocks = kv_blocks(config, roofline)
    name = config.kv_manager or POLICY_MEMORY[config.policy]
    if device.efficiency.host_overlap and (not scheduler_class(config.policy).ASYNC_SCHEDULING
                                           or name in NEEDS_HOST_STORE):
        # as the real engine refuses it (builder.check_async_scheduling)
        raise ValueError(f"host_overlap models asynchronous scheduling, which {config.policy!r} with the "
                         f"{name!r} KV manager cannot do")
    scale = config.scheduling_time_scale
    if scale is not None and (device.efficiency.host_overlap or scale < 0):
        raise ValueError("scheduling_time_scale must be >= 0, and charges planning in series: not with host_overlap")
    host = None
    tier_blocks = config.prefix_cache_host_tokens // config.block_size
    if tier_blocks and (name != "paged" or not config.enable_prefix_caching):
        raise ValueError("a host tier for the prefix cache needs the paged KV manager with prefix caching")
    if name in NEEDS_HOST_STORE or tier_blocks:
        host_tokens = (tier_blocks * config.block_size if tier_blocks else
                       config.host_kv_tokens if config.host_kv_tokens is not None else num_blocks * config.block_size)
        # Bookkeeping only: no layers, and nothing to page-lock (which would open a CUDA context).
        host = HostKVStore(host_tokens // config.block_size, config.block_size, 0, 1, 1, torch.float16,
                           pin_memory=False)
    kv = make_kv_manager(name, KVBuildContext(num_blocks, config.block_size, roofline.model, host,
                                              config.kv_manager_options or {},
                                              link_block_seconds=roofline.kv_copy_seconds(config.block_size, "pcie"),
                                              prefix_caching=config.enable_prefix_caching,
                                              prefix_host_blocks=tier_blocks,
                                              recompute_seconds=roofline.chunk_seconds))
    max_len = min(config.max_model_len or roofline.model.max_position_embeddings, kv.max_request_tokens)
    sched_config = SchedulerConfig(max_num_batched_tokens=config.max_num_batched_tokens,
                                   max_num_seqs=config.max_num_seqs, max_model_len=max_len, policy=config.policy,
                                   online_slo=config.online_slo, offline_slo=config.offline_slo,
                                   policy_options=dict(config.policy_options or {}))
    policy_model = fitted_cost_model(roofline, max_len) if config.fitted_policy_model else None
    executor = SimExecutor(clock, executor_cost or roofline, output_lens, copy_cost=roofline,
                           preempt_every_layers=config.preempt_every_layers,
                           record_online_gaps=config.record_online_token_gaps, host_store=host,
                           layerwise_copies=config.layerwise_copies,
                           scheduling_time_scale=config.scheduling_time_scale)
    engine = Engine(make_scheduler(sched_config, kv, policy_model, clock=clock), executor, None,
                    frozenset({EOS_TOKEN}), model_name=config.model,
                    calibrate_cost_model=config.calibrate_cost_model, stream_outputs=False)
    return engine, executor, roofline


def simulate(config: SimConfig, trace: list[TraceRequest], executor_cost: Roofline | CostModel | None = None,
             max_steps: int = 10_000_000, closed_loop: ClosedLoopBatches | None = None) -> SimResult:
    """Run `trace` (open loop: each request at its arrival) and, if given, `closed_loop`'s batches
    (each submitted when the one before it has completed) through one engine. The i-th request
    is "sim-i": the trace's first, then the closed-loop batches' in order. A closed-loop batch
    that was never submitted (the run ended, or `until` passed) has no records."""
    start = min([r.arrival for r in trace[:1]] + ([closed_loop.start] if closed_loop else []), default=0.0)
    clock = VirtualClock(start)
    specs = list(trace) + [r for batch in (closed_loop.batches if closed_loop else ()) for r in batch]
    ids = [f"sim-{i}" for i in range(len(specs))]
    output_lens = {i: r.output_len for i, r in zip(ids, specs)}
    index_of = {request_id: i for i, request_id in enumerate(ids)}
    engine, executor, _ = build(config, output_lens, clock, executor_cost)
    pending = deque(sorted(zip(ids, trace), key=lambda item: item[1].arrival))
    arrivals = {request_id: spec.arrival for request_id, spec in zip(ids, trace)}  # as submitted
    finished: dict[str, RequestOutput] = {}
    usage: list[tuple[float, float]] = []
    generated: list[tuple[float, int, int]] = []

    def add(request_id: str, spec: TraceRequest, arrival: float) -> None:
        # max_tokens only bounds the context; the workload's EOS ends the request.
        params = SamplingParams(temperature=0, max_tokens=max(1, engine.config.max_model_len - spec.prompt_len))
        prompt = prompt_token_ids(spec, index_of[request_id], min(spec.prompt_len, engine.config.max_model_len - 1),
                                  FILLER_TOKEN)
        engine.add_request(prompt, params, request_id, arrival_time=arrival, priority=spec.priority)

    def admit_arrivals() -> None:
        while pending and pending[0][1].arrival <= clock.now:
            request_id, spec = pending.popleft()
            add(request_id, spec, spec.arrival)

    # Closed loop: the batch in the system (its ids still unfinished) and the next to submit.
    loop_ids = iter(ids[len(trace):])
    loop_batches = iter(closed_loop.batches if closed_loop else ())
    loop_open: set[str] = set()
    loop_next = closed_loop.start if closed_loop else math.inf  # when the next batch may go in

    def submit_batch() -> None:
        """The next closed-loop batch, if its time has come (the last one completed) and not past `until`."""
        nonlocal loop_next
        # Without a closed loop, loop_next is inf: the test on closed_loop only narrows its type.
        if loop_open or clock.now < loop_next or closed_loop is None or clock.now > closed_loop.until:
            return
        batch = next(loop_batches, None)
        if batch is None:
            loop_next = math.inf
            return
        for spec in batch:
            request_id = next(loop_ids)
            arrivals[request_id] = clock.now
            loop_open.add(request_id)
            add(request_id, spec, clock.now)

    def loop_waiting() -> bool:
        return closed_loop is not None and not loop_open and loop_next <= closed_loop.until

    engine.on_safe_point(admit_arrivals)
    stop_at = clock.now + config.horizon if config.horizon is not None else math.inf
    idle_steps = 0  # steps in a row at this instant that ran no forward and had nothing to wait for
    while (pending or engine.has_unfinished_requests() or loop_waiting()) and clock.now < stop_at:
        admit_arrivals()
        if closed_loop is not None:
            submit_batch()
        if not engine.has_unfinished_requests():
            later = [t for t in (pending[0][1].arrival if pending else None,
                                 loop_next if loop_waiting() else None) if t is not None]
            if not later:
                break
            clock.advance_to(min(later))
            continue
        steps, forwards = executor.stats.steps, executor.stats.forwards
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
                if out.request_id in loop_open:
                    loop_open.discard(out.request_id)
                    if not loop_open:
                        loop_next = clock.now  # the batch completed: the next goes in now
        if executor.stats.forwards == forwards:  # the policy scheduled nothing, or only copies
            # Nothing changes until a request arrives or a copy lands (its manager learns it at
            # the next step's poll): both lie strictly after now, so the clock always moves.
            later = [t for t in (pending[0][1].arrival if pending else None, executor.next_landing(),
                                 loop_next if loop_waiting() and loop_next > clock.now else None)
                     if t is not None]
            if later:
                clock.advance_to(min(later))
                idle_steps = 0
            elif executor.stats.steps > steps and idle_steps < MAX_IDLE_STEPS:
                # Copies only, all landed at once (nothing on the link): the next poll sees them,
                # which may let the policy run something at this very instant.
                idle_steps += 1
            else:
                raise RuntimeError(f"{config.policy} scheduled nothing with "
                                   f"{len(ids) - len(finished)} requests unfinished, none arriving "
                                   "and no KV copy in flight")
        else:
            idle_steps = 0
        usage.append((clock.now, engine.kv.num_used_blocks / max(1, engine.kv.num_blocks)))
        if not generated or generated[-1][1] != engine.generation_tokens_total:
            generated.append((clock.now, engine.generation_tokens_total, executor.stats.online_tokens))
        if executor.stats.steps > max_steps:
            raise RuntimeError(f"simulation exceeded {max_steps} steps")
    records = []
    for request_id, spec in zip(ids, specs):
        arrival = arrivals.get(request_id)
        if arrival is None:
            continue  # a closed-loop batch never submitted
        if request_id in finished:
            m = finished[request_id].metrics
            records.append(RequestRecord(request_id, spec.priority, arrival, spec.prompt_len, spec.output_len,
                                         m.ttft, m.tpot, m.e2e, m.num_preemptions, finished[request_id].finish_reason))
            continue
        request = engine.requests.get(request_id)  # None: it never arrived before the horizon
        first = request.first_token_time if request is not None else None
        records.append(RequestRecord(request_id, spec.priority, arrival, spec.prompt_len, spec.output_len,
                                     None if first is None else first - arrival, None, None,
                                     request.num_preemptions if request is not None else 0, None))
    stats = executor.stats
    extra = {"layerwise_preemptions": executor.preemption.num_preempted,
             "discarded_forward_seconds": stats.discarded_seconds,
             "scheduler_counters": engine.scheduler.counters(),
             # wall seconds the policy took to plan the steps that ran (this machine's CPU), and
             # what `scheduling_time_scale` charged of it to the virtual clock (0 when None)
             "plan_wall_seconds": executor.plan_wall_seconds, "scheduling_seconds": executor.scheduling_seconds}
    return SimResult(config, records, usage, dict(engine.kv.events), steps=stats.steps,
                     busy_seconds=stats.busy_seconds, link_busy_seconds=stats.link_busy_seconds,
                     forward_stall_seconds=stats.forward_stall_seconds, duration=clock.now - start, extra=extra,
                     generated=generated, online_token_gaps=executor.online_gaps or [])
