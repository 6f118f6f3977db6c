"""A simulated KunServe cluster (kunserve.txt §3, §4.1-§4.4, §5.1): N instances, each a real
engine (the policy's scheduler, a paged KV manager) on its own virtual clock, behind the
Llumnix-style dispatcher, with the throttling monitor, drop and restore of cluster/ reused as
they are:

    dist.cluster.Dispatcher        least-loaded routing by KV demand, held plus the whole
                                   queue's (§3, Llumnix's virtual usage)
    dist.cluster.ThrottleMonitor   an instance is throttled when its head-of-line request
                                   cannot get KV: its blocks short are Fig. 6's R
    dist.regroup.Regrouper         drop (plan_drop, Fig. 6; split_pool), restore (demand at most
                                   50% of the replicas' capacity, §4.4), driving the four phases
                                   of sim/cluster_layout.py's SimMember instead of processes
    dist.instance.load_of          what the dispatcher and the monitor read of an instance

Discrete events. Each instance has its own clock. The loop always serves the earliest event:
the next arrival if no instance with work is behind it (the dispatcher routes it, an idle
instance's clock jumps to it), else a step of the instance furthest behind. After every step
the monitor reads every instance's load, as dist.cluster.Cluster does after a lockstep step;
one layout change at a time. The dispatcher reads what the real one can: each instance's load
as of its latest step (or layout change), plus what it booked against it since. That is how
vLLM's engines (the paper's base) step; `stepping="lockstep"` steps the instances as nanoserve's
real cluster does by default instead (`_run_lockstep`), `"group_lockstep"` as its asynchronous
front does, and `remap="host_staged"` prices its layout
changes' copies (sim/cluster_layout.py), so the simulator can say what each costs.

The configurations of the paper's comparison (§5.1 baselines):
- vLLM: replicas, fcfs with recompute preemption (`drop=False`);
- vLLM (PP): `static_pipeline_stages=2`, pairs of instances as fixed two-stage pipelines from the
  start, each member scheduling half of the pair's KV (vLLM's virtual engines);
- InferCept-like: replicas whose instances swap (the instance's `kv_manager="swap"`): each
  instance's executor files its copies in its manager's host store, and an instance with nothing
  to run waits for its next copy to land, as `simulate()` does;
- Llumnix-like: replicas with `migration` (sim/migration.py), whose migrator's stage ends and
  polls are events of the loop beside arrivals and steps;
- KunServe: `drop=True`, the kunserve policy (§4.3's lookahead), drops and restores.

§3: after a drop "KunServe re-schedules queued requests": the requests still queued, never
started, on throttled instances the drop did not enlarge go back through the dispatcher
(`redispatch_queued`), as Fig. 6 merges the smallest groups, not necessarily the throttled one.
"""
from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from nanoserve.cluster.cluster import PREFIX_SLACK, Dispatcher, ThrottleMonitor
from nanoserve.cluster.instance import load_of
from nanoserve.cluster.load import InstanceLoad
from nanoserve.cluster.regroup import LayoutChange, Regrouper
from nanoserve.cluster.round_robin_dispatch import RoundRobinDispatcher
from nanoserve.memory.prefix_cache import block_hashes
from nanoserve.outputs import RequestOutput
from nanoserve.sampling import SamplingParams
from nanoserve.sim.cluster_layout import PipelineExecutor, SimMember, StagePipeline, bubble_ratio
from nanoserve.sim.executor import FILLER_TOKEN, VirtualClock
from nanoserve.sim.metrics import downsample
from nanoserve.sim.migration import LlumnixMigrator, MigrationConfig
from nanoserve.sim.models import ModelCost
from nanoserve.sim.simulation import MAX_IDLE_STEPS, RequestRecord, SimConfig, SimResult, build
from nanoserve.sim.workloads import TraceRequest, prompt_token_ids

DISPATCHERS = ("least-loaded", "round-robin")  # ClusterConfig.dispatch
REMAPS = ("in_place", "host_staged")  # ClusterConfig.remap
STEPPINGS = ("independent", "group_lockstep", "lockstep")  # ClusterConfig.stepping
DEMAND_POINTS = 5000  # kv_demand_series samples kept per run


@dataclass(frozen=True)
class ClusterConfig:
    instance: SimConfig  # every instance's engine: policy, GPU, model (tp = 1)
    num_instances: int = 8
    drop: bool = False  # KunServe: drop layers when throttled, restore when demand fades
    static_pipeline_stages: int = 1  # > 1: vLLM (PP), fixed pipelines of this many instances
    # KunServe's 14B cluster (Table 2, cluster A) has one GPU per server, so KV exchange, weight
    # pulls and activations cross 200 Gbps RDMA.
    link: str = "network"
    restore_fraction: float = 0.5  # §4.4; below 0 a group never restores (Fig. 15's ablation)
    # §4.4: "we overlap restoring with the normal request processing". True: the groups keep
    # serving in their pipelines while the dropped layers are pulled, and switch back once the
    # weights are in (cancelled if throttling returns first). False: every member of a
    # restored group waits for its pull, as before (an ablation).
    background_restore: bool = True
    redispatch_queued: bool = True  # §3, see the module docstring
    migration: MigrationConfig | None = None  # Llumnix: migrate running requests (sim/migration.py)
    # Ours, for benchmarks/pipeline.py --sim: in a pipeline, a step the policy did not cut runs
    # as token-count micro-batches (KunServe's Fig. 17 (a) baseline, `PipelineExecutor`), not
    # as one micro-batch.
    token_count_cut: bool = False
    # Where the instances cache prefixes (`instance.enable_prefix_caching`): the dispatcher also
    # routes by prefix, within this slack of the least load (cluster.Dispatcher; ours). None:
    # by load alone.
    prefix_slack: float | None = PREFIX_SLACK
    # Fig. 6's R: "queue", every queued request's blocks on the throttled instances (§4.1), or
    # "head", the head-of-line shortfall (cluster/regroup.py `Regrouper.blocks_to_free`).
    drop_demand: str = "queue"
    # A member's max_num_seqs follows its pool after a layout change (`SimMember.seq_limit`).
    seqs_follow_pool: bool = True
    # "least-loaded": cluster.Dispatcher (Llumnix's virtual usage, §3); "round-robin":
    # cluster/round_robin_dispatch.py, the paper-era baselines' balancer (an assumption there).
    dispatch: str = "least-loaded"
    # How a layout change gives the freed weight memory to KV (sim/cluster_layout.py `SimMember`).
    # "in_place": the paper's (§4.1), the dropped layers' pages mapped to the KV region's tail
    # with cuMemMap, so KV that stays on its GPU is not copied. "host_staged": nanoserve's real
    # cluster (cluster/member.py), which stages every live block in host memory, re-carves the
    # arena and copies back what stays: both directions priced over PCIe.
    remap: str = "in_place"
    # How the instances take steps. "independent": each on its own clock, as vLLM's engines (and
    # a group's members, vLLM's virtual engines) do, so a member's next micro-batches enter the
    # stages while its peer's are still in them: the paper's. "lockstep": nanoserve's real cluster
    # (cluster/cluster.py `Cluster.step`), where every instance steps from one instant, the front
    # reads every reply, and the next step starts when the slowest instance is done (`_run_lockstep`).
    # "group_lockstep": only each group's members step together (`GroupExecutor`'s lockstep),
    # instances and groups each on their own: the real cluster's asynchronous front
    # (`Cluster(stepping="group_lockstep")`). The real cluster comes nearest "independent" with
    # that front and `async_pipeline` (a group's steps in flight, each stage on a different one),
    # though its members still meet once a step to exchange step messages.
    stepping: str = "independent"

    def __post_init__(self) -> None:
        if self.dispatch not in DISPATCHERS:
            raise ValueError(f"dispatch must be one of {', '.join(DISPATCHERS)}, not {self.dispatch!r}")
        if self.remap not in REMAPS:
            raise ValueError(f"remap must be one of {', '.join(REMAPS)}, not {self.remap!r}")
        if self.stepping not in STEPPINGS:
            raise ValueError(f"stepping must be one of {', '.join(STEPPINGS)}, not {self.stepping!r}")
        if self.stepping != "independent" and self.migration is not None:
            raise ValueError("lockstep models nanoserve's real cluster, which does not migrate requests")
        if self.instance.tp != 1:
            raise ValueError("each simulated instance is one GPU (tp = 1)")
        if self.instance.enable_prefix_caching and (self.drop or self.static_pipeline_stages > 1
                                                    or self.migration is not None):
            raise ValueError("prefix caching runs on replicas without drops, static pipelines or migration "
                             "(a layout change re-carves the pool; a migration reserves blocks it then copies)")
        stages = self.static_pipeline_stages
        if self.num_instances < 1 or stages < 1 or stages & (stages - 1) or self.num_instances % stages:
            raise ValueError("static pipelines need a power-of-two depth that divides the instances")
        if self.drop and self.static_pipeline_stages > 1:
            raise ValueError("drop starts from replicas")
        if self.migration is not None and (self.drop or stages > 1):
            raise ValueError("migration moves requests between replicas")
        if self.instance.kv_manager not in (None, "paged"):
            if self.drop or stages > 1:
                raise ValueError("a layout change rebuilds a paged pool: drop and static pipelines need paged KV")
            if self.migration is not None:
                raise ValueError("migration reserves and copies device blocks only: it needs paged KV")


class SimCluster:
    def __init__(self, config: ClusterConfig, trace: list[TraceRequest]):
        self.config = config
        start = min((r.arrival for r in trace), default=0.0)
        self.ids = [f"sim-{i}" for i in range(len(trace))]
        self.trace = dict(zip(self.ids, trace))
        self.index = {request_id: i for i, request_id in enumerate(self.ids)}  # prompt_token_ids' index
        output_lens = {i: r.output_len for i, r in self.trace.items()}
        self.members: dict[int, SimMember] = {}
        self.pipelines: list[StagePipeline] = []  # every one built, for the GPUs' busy seconds
        for i in range(config.num_instances):
            clock = VirtualClock(start)
            engine, built, roofline = build(config.instance, output_lens, clock)
            alone = StagePipeline(roofline, [range(roofline.model.num_layers)], config.link, [start])
            executor = PipelineExecutor(clock, roofline, output_lens, alone, host_store=built.host_store,
                                        layerwise_copies=config.instance.layerwise_copies,
                                        token_count_budget=config.instance.max_num_batched_tokens
                                        if config.token_count_cut else None)
            engine.use_executor(executor)
            self.pipelines.append(executor.pipeline)
            self.members[i] = SimMember(i, engine, executor, clock, config.instance, config.link, self.members,
                                        config.seqs_follow_pool, host_staged=config.remap == "host_staged")
        self.roofline = roofline
        cost = ModelCost(roofline.model)
        self.block_bytes = cost.kv_bytes_per_token * config.instance.block_size  # a replica's block
        self.regrouper = Regrouper(config.num_instances, [cost.layer_bytes] * roofline.model.num_layers,
                                   self.block_bytes, restore_fraction=config.restore_fraction,
                                   drop_demand=config.drop_demand)
        self.dispatcher: Dispatcher | RoundRobinDispatcher = (
            Dispatcher(config.prefix_slack if config.prefix_slack is not None else PREFIX_SLACK)
            if config.dispatch == "least-loaded" else RoundRobinDispatcher())
        self.monitor = ThrottleMonitor()
        self.changes: list[tuple[float, LayoutChange]] = []
        self.events = {"throttled_steps": 0, "drops": 0, "restores": 0, "requeued": 0, "restores_cancelled": 0}
        # A restore whose weights are being pulled in the background: (groups, when they are in).
        self._pending_restore: tuple[list, float] | None = None
        self._idle_steps: Counter[int] = Counter()  # copies-only steps in a row at one instant, per instance
        self.finished: dict[str, RequestOutput] = {}
        self.placement: dict[str, int] = {}  # request id -> the instance serving it
        self.first_throttle = math.inf
        self.usage: list[tuple[float, float]] = []  # (time, blocks used / blocks), after each step
        # (time, KV demand / blocks): blocks held plus every queued request's blocks.
        self.demand: list[tuple[float, float]] = []
        # (time, (blocks held + head-of-line blocks) / blocks): §2.2's measure ("a standard approach
        # [41] that counts ... the in-processing requests and head-of-line queuing requests").
        self.head_demand: list[tuple[float, float]] = []
        self.peak_running = 0  # the most requests any instance ran at once
        if config.static_pipeline_stages > 1:
            # Fig. 6 from replicas merges the two smallest groups first, so asking it to free
            # N - N/k copies of the layers pairs the instances up into N/k groups of k (k = 2^j).
            copies = config.num_instances - config.num_instances // config.static_pipeline_stages
            self._apply(self.regrouper.drop({0: -(-copies * cost.layer_bytes * roofline.model.num_layers
                                                  // self.block_bytes)}, self._loads(), self._call), start)
        # What the dispatcher knows of each instance: its load at its latest report.
        self.reported: dict[int, InstanceLoad] = self._loads()
        self.migrator = None if config.migration is None else LlumnixMigrator(
            config.migration, self.members, config.link, self.block_bytes, start, self.placement.__setitem__)

    # -- the phases, as cluster.Cluster.call_all sends them ------------------------------------
    def _call(self, messages: Mapping[int, tuple]) -> dict[int, object]:
        return {i: self.members[i].phase(kind)(*args) for i, (kind, *args) in messages.items()}

    def _loads(self) -> dict[int, InstanceLoad]:
        return {i: load_of(m) for i, m in self.members.items()}

    def _apply(self, change: LayoutChange | None, now: float) -> set[int]:
        """Give every group that changed a fresh pipeline; returns the instances involved."""
        if change is None:
            return set()
        self.changes.append((now, change))
        before = {g.instances: g for g in change.before}
        involved = set()
        for group in change.after:
            if before.get(group.instances) == group:
                continue
            involved |= set(group.instances)
            members = [self.members[i] for i in group.instances]
            pipeline = StagePipeline(self.roofline, group.stages, self.config.link, [m.clock.now for m in members])
            self.pipelines.append(pipeline)
            for m in members:
                m.executor.run_on(pipeline)
                m.engine.kv.check_invariants()
        return involved

    # -- requests ---------------------------------------------------------------------------
    def dispatch(self, request_id: str, now: float) -> int:
        spec = self.trace[request_id]
        size = self.config.instance.block_size
        blocks = -(-spec.prompt_len // size)
        prompt = prompt_token_ids(spec, self.index.setdefault(request_id, len(self.index)), spec.prompt_len,
                                  FILLER_TOKEN)
        # As cluster.Cluster routes: by prefix too where the instances cache prefixes.
        hashes = block_hashes(prompt, size, [], (len(prompt) - 1) // size) \
            if self.config.instance.enable_prefix_caching and self.config.prefix_slack is not None else []
        member = self.members[self.dispatcher.pick(list(self.reported.values()), blocks, hashes)]
        engine = member.engine
        prompt = prompt[:engine.config.max_model_len - 1]
        if not engine.has_unfinished_requests():
            member.clock.advance_to(now)  # it idled (or only waited for K/V) until this request came
        # max_tokens only bounds the context; the workload's EOS ends the request.
        prompt_len = min(spec.prompt_len, engine.config.max_model_len - 1)
        params = SamplingParams(temperature=0, max_tokens=max(1, engine.config.max_model_len - prompt_len))
        engine.add_request(prompt, params, request_id, arrival_time=spec.arrival, priority=spec.priority)
        self.placement[request_id] = member.id
        return member.id

    def _report_all(self) -> None:
        """Every instance reports its load now (dist.cluster.Cluster._refresh_loads)."""
        for i, member in self.members.items():
            self.reported[i] = load_of(member)
            self.dispatcher.reported(i)

    def _redispatch(self, throttled: set[int], now: float) -> None:
        fresh = []
        for i in sorted(throttled):
            engine = self.members[i].engine
            never_started = [r for r in engine.scheduler.waiting if r.num_computed_tokens == r.num_output_tokens == 0]
            for request in never_started:
                engine.abort_request(request.request_id)  # it held no KV and produced nothing
                fresh.append(request.request_id)
        self._report_all()  # the throttled instances' queues without them, the drop's pools
        for request_id in fresh:
            self.dispatch(request_id, now)
            self.events["requeued"] += 1

    # -- the loop ---------------------------------------------------------------------------
    def run(self, max_steps: int = 10_000_000) -> None:
        """Serve the trace to the end (requests already dispatched by hand stay where they are)."""
        pending = deque(sorted((i for i in self.ids if i not in self.placement),
                               key=lambda i: self.trace[i].arrival))
        if self.config.stepping == "lockstep":
            self._run_lockstep(pending, max_steps)
            return
        steps = 0
        while True:
            member = min(self.members.values(), key=lambda m: (m.next_time(), m.id))
            busy_at = member.next_time()
            arrival = self.trace[pending[0]].arrival if pending else math.inf
            migration_at = self._migration_time()
            if arrival == busy_at == migration_at == math.inf:
                return
            if migration_at <= min(arrival, busy_at):
                assert self.migrator is not None  # without one, migration_at is inf
                self.migrator.advance(migration_at)
                continue
            if arrival <= busy_at:
                self.dispatch(pending.popleft(), arrival)
                continue
            if self.config.stepping == "group_lockstep" and not member.layout.solo:
                self._step_together([self.members[i] for i in sorted(member.layout.members)], arrival)
            else:
                self._step(member, arrival)
            steps += 1
            if steps > max_steps:
                raise RuntimeError(f"cluster simulation exceeded {max_steps} steps")

    def _migration_time(self) -> float:
        if self.migrator is None:
            return math.inf
        return self.migrator.next_time(any(m.has_work() for m in self.members.values()))

    def _run_lockstep(self, pending: deque[str], max_steps: int) -> None:
        """`ClusterConfig.stepping="lockstep"`: what nanoserve's real cluster does. Each cluster
        step is `_step_together` over every instance; requests that arrived meanwhile are
        dispatched before the next step."""
        members = list(self.members.values())
        steps = 0
        while True:
            now = max(m.clock.now for m in members)
            while pending and self.trace[pending[0]].arrival <= now:
                self.dispatch(pending.popleft(), now)
            arrival = self.trace[pending[0]].arrival if pending else math.inf
            start = min((m.next_time() for m in members if m.has_work()), default=math.inf)
            if arrival == start == math.inf:
                return
            if arrival < max(now, start):  # idle (or every request waits for its K/V) until it comes
                for m in members:
                    m.clock.advance_to(arrival)
                continue
            self._step_together(members, arrival)
            steps += 1
            if steps > max_steps:
                raise RuntimeError(f"cluster simulation exceeded {max_steps} steps")

    def _step_together(self, group: list[SimMember], next_arrival: float) -> None:
        """One step of `group` in lockstep, as nanoserve's real cluster steps (`Cluster.step` over
        every instance; `GroupExecutor` over a group's members): the members with work start at
        one instant, in id order, so a group's members push their micro-batches into the stages
        in that order (each stage takes every member's batch before the next step); every member
        ends when the slowest is done; then the monitor looks, once."""
        working = [m for m in group if m.has_work()]
        start = max(max(m.clock.now for m in group), min(m.next_time() for m in working))
        for m in group:
            m.clock.advance_to(start)
        progressed = [self._serve(m) for m in working]
        end = max(m.clock.now for m in group)
        for m in group:
            m.clock.advance_to(end)
            self.reported[m.id] = load_of(m)
            self.dispatcher.reported(m.id)
        key = group[0].id
        if any(progressed):
            self._idle_steps[key] = 0
        else:  # nothing fits until a stalled request's K/V, a copy, a request or another step comes
            others = [m for m in self.members.values() if m not in group]
            events = (next_arrival, *(ready for m in group for _, ready in m.stalled.values()),
                      *(m.executor.next_landing() for m in group), *(m.next_time() for m in others))
            later = [t for t in events if t is not None and end < t < math.inf]
            if later:
                for m in group:
                    m.clock.advance_to(min(later))
            elif self._idle_steps[key] < MAX_IDLE_STEPS:
                self._idle_steps[key] += 1
            else:
                raise RuntimeError(f"instances {[m.id for m in group]} can schedule nothing and nothing will change")
        self._monitor(end)

    def _serve(self, member: SimMember) -> bool:
        """One engine step of `member` at its clock (its K/V that has arrived by then back
        among the running first); returns whether it ran a forward pass."""
        member.unstall()
        engine, executor = member.engine, member.executor
        forwards = executor.stats.forwards
        if engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    if out.request_id in self.finished:
                        raise RuntimeError(f"{out.request_id} finished twice")
                    self.finished[out.request_id] = out
        return executor.stats.forwards > forwards

    def _step(self, member: SimMember, next_arrival: float) -> None:
        member.clock.advance_to(member.next_time())
        engine, executor = member.engine, member.executor
        before = executor.stats.steps
        if not self._serve(member) and engine.has_unfinished_requests():
            # Nothing fits until something else happens: a stalled request's K/V arrives, a copy
            # to or from the host lands (its manager learns it at the next step's poll), a
            # request arrives, or another instance's step (and a drop it may trigger).
            landing = executor.next_landing()
            later = [t for t in (next_arrival, landing, self._migration_time(),
                                 *(m.next_time() for m in self.members.values()),
                                 *(ready for _, ready in member.stalled.values()))
                     if t is not None and member.clock.now < t < math.inf]
            if later:
                member.clock.advance_to(min(later))
                self._idle_steps[member.id] = 0
            elif executor.stats.steps > before and self._idle_steps[member.id] < MAX_IDLE_STEPS:
                self._idle_steps[member.id] += 1  # copies only, landed at once: the next poll sees them
            else:
                raise RuntimeError(f"instance {member.id} can schedule nothing and nothing will change")
        self.reported[member.id] = load_of(member)
        self.dispatcher.reported(member.id)
        self._monitor(member.clock.now)

    def _monitor(self, now: float) -> None:
        """dist.cluster.Cluster.step's look at the loads after a step."""
        loads = self._loads()
        total, used = (sum(getattr(load, f) for load in loads.values()) for f in ("total_blocks", "used_blocks"))
        self.usage.append((now, used / total))
        # §2.2 counts the head-of-line request; a queue that waits for compute (or max_num_seqs),
        # not for KV, would hide behind its head, so every queued request counts here.
        self.demand.append((now, sum(load.virtual_blocks for load in loads.values()) / total))
        self.head_demand.append((now, sum(load.demand_blocks for load in loads.values()) / total))
        self.peak_running = max(self.peak_running, *(load.num_running for load in loads.values()))
        short = self.monitor.short_blocks(list(loads.values()))
        if short:
            self.events["throttled_steps"] += 1
            self.first_throttle = min(self.first_throttle, now)
        if not self.config.drop or any(load.exchanging for load in loads.values()):
            return  # one layout change at a time
        if short and self._pending_restore is not None:
            self._drop_pending_restore()  # demand is back: the pulled weights are not used
            self.events["restores_cancelled"] += 1
        if short:
            involved = self._apply(self.regrouper.drop(short, loads, self._call), now)
            if involved:
                self.events["drops"] += 1
                self._report_all()
                if self.config.redispatch_queued:
                    self._redispatch(set(short) - involved, now)
            return
        groups = self.regrouper.restorable(loads)
        if self.config.background_restore:
            groups = self._restore_when_pulled(groups, now)
        if groups:
            self._apply(self.regrouper.restore(groups, loads, self._call), now)
            self.events["restores"] += 1
            self._report_all()

    def _restore_when_pulled(self, restorable: list, now: float) -> list:
        """§4.4's overlapped restore: the first time groups are restorable their members start
        pulling the layers they lack (over the link, each at its own rate; §4.2's coordination
        gives activations priority, so the pipelines are not slowed) and go on serving. The
        groups whose pulls are in by `now` and are still restorable are returned (their members'
        reweigh then waits for nothing); the rest wait. Assumption: where the pulled weights sit
        until the switch is not modelled (the paper restores below 50% KV usage, so the memory
        is free), and a pull does not slow the activations sharing the link."""
        if self._pending_restore is None:
            if restorable:
                ready = max(now + self.members[i].pull_seconds() for g in restorable for i in g.instances)
                for i in {i for g in restorable for i in g.instances}:
                    self.members[i].prefetch_all_layers()
                self._pending_restore = (restorable, ready)
            return []
        pending, ready = self._pending_restore
        if now < ready:
            return []
        kept = [g for g in pending if g in restorable]
        self._drop_pending_restore(keep=kept)
        return kept

    def _drop_pending_restore(self, keep: Sequence = ()) -> None:
        """End the pending restore; its members' pulled layers are discarded, `keep`'s excepted."""
        assert self._pending_restore is not None
        kept = {i for g in keep for i in g.instances}
        for group in self._pending_restore[0]:
            for i in set(group.instances) - kept:
                self.members[i].prefetched = False
        self._pending_restore = None

    # -- the result -------------------------------------------------------------------------
    def result(self) -> SimResult:
        missing = [i for i in self.ids if i not in self.finished]
        if missing:
            raise RuntimeError(f"{len(missing)} requests never finished (first: {missing[0]})")
        records = []
        for request_id in self.ids:
            spec, out = self.trace[request_id], self.finished[request_id]
            m = out.metrics
            records.append(RequestRecord(request_id, spec.priority, spec.arrival, spec.prompt_len, spec.output_len,
                                         m.ttft, m.tpot, m.e2e, m.num_preemptions, out.finish_reason))
        members = self.members.values()
        events = dict(self.events, preemptions=sum(m.engine.scheduler.num_preemptions for m in members),
                      **(self.migrator.events if self.migrator is not None else {}))
        if self.config.instance.enable_prefix_caching:
            for key in ("prefix_cache_queries", "prefix_cache_hits"):
                events[key] = sum(m.engine.kv.events.get(key, 0) for m in members)
            events["prefix_routed"] = self.dispatcher.prefix_routed
        start = min((r.arrival for r in records), default=0.0)
        last_arrival = max((r.arrival for r in records), default=0.0)
        end = max((r.arrival + r.e2e for r in records if r.e2e is not None), default=start)
        extra = {
            "layout_changes": [{"time": t, "kind": c.kind,
                                "groups": [list(g.instances) for g in c.after if g.size > 1],
                                "capacity_before": c.capacity_before, "capacity_after": c.capacity_after,
                                "kv_bytes_sent": c.kv_bytes_sent} for t, c in self.changes],
            "first_throttle": self.first_throttle,
            # How concentrated the TTFT tail is: the largest share of the slowest 1% on one instance.
            **dict(zip(("tail_instance", "tail_on_one_instance"), _tail(records, self.placement))),
            "kv_exchange_bytes": sum(m.sent_bytes for m in members),
            # `remap="host_staged"`: KV copied to host memory and back by layout changes, and the
            # seconds those copies stopped the instances (summed over instances); 0 in place.
            "kv_staged_bytes": sum(m.staged_bytes for m in members),
            "kv_staging_seconds": sum(m.staging_seconds for m in members),
            "weight_pull_bytes": sum(m.pulled_bytes for m in members),
            # Over the arrivals' span: the drain after the last arrival is not the trace's load.
            "kv_demand_mean": time_average([(t, d) for t, d in self.demand if t <= last_arrival]),
            # The same over §2.2's measure (held plus the heads of the queues), and the KV held.
            "kv_head_demand_mean": time_average([(t, d) for t, d in self.head_demand if t <= last_arrival]),
            "kv_held_mean": time_average([(t, u) for t, u in self.usage if t <= last_arrival]),
            # (time, KV demand / blocks) after each step, thinned for plots (Fig. 12's first column).
            "kv_demand_series": downsample(sorted(self.demand), DEMAND_POINTS),
            # The longest K/V stall each layout change caused on each instance (§4.2's exchange).
            "kv_exchange_stall_seconds": sum(m.exchange_seconds for m in members),
            # The most requests any instance ran at once, and its cap then (max_num_seqs follows a
            # member's pool after a drop: `ClusterConfig.seqs_follow_pool`).
            "peak_running": self.peak_running,
            # §5.3's bubble time over the pipelined groups (KunServe's after a drop, vLLM-PP's):
            # the stages' idle share while their pipe had work; None where none ran.
            "pipeline_bubble_ratio": bubble_ratio([p for p in self.pipelines if len(p.stages) > 1]),
        }
        # Busy: GPU-seconds the stages computed (an executor's own count would add waits for a
        # stage). The link: each instance's device-host copies (none over paged KV).
        return SimResult(self.config.instance, records, sorted(self.usage), events,
                         steps=sum(m.executor.stats.steps for m in members),
                         busy_seconds=sum(sum(p.busy) for p in self.pipelines),
                         link_busy_seconds=sum(m.executor.stats.link_busy_seconds for m in members),
                         forward_stall_seconds=sum(m.executor.stats.forward_stall_seconds for m in members),
                         duration=end - start, extra=extra)


def _tail(records: list[RequestRecord], placement: Mapping[str, int]) -> tuple[int | None, float]:
    """The instance holding most of the slowest 1% (by TTFT), and the share it holds."""
    timed = [(r.ttft, r) for r in records if r.ttft is not None]
    slowest = [r for _, r in sorted(timed, key=lambda pair: -pair[0])[:max(1, len(records) // 100)]]
    if not slowest:
        return None, 0.0
    instance, count = Counter(placement[r.request_id] for r in slowest).most_common(1)[0]
    return instance, count / len(slowest)


def time_average(series: list[tuple[float, float]]) -> float:
    """Each sample holds until the next one (as metrics.kv_usage_summary weighs KV usage)."""
    series = sorted(series)
    span = series[-1][0] - series[0][0] if series else 0.0
    if span <= 0:
        return sum(v for _, v in series) / len(series) if series else 0.0
    return sum(v * (t1 - t0) for (t0, v), (t1, _) in zip(series, series[1:])) / span


def simulate_cluster(config: ClusterConfig, trace: list[TraceRequest]) -> SimResult:
    """One run of `trace` through the cluster: every request finishes exactly once (or raises)."""
    cluster = SimCluster(config, trace)
    cluster.run()
    return cluster.result()
