"""One simulated instance of a KunServe cluster (kunserve.txt §4.1, §4.2, §4.3, §4.4): the
member side of a layout change, on virtual time, and what a step costs in a pipeline group.

A `SimMember` answers the four phases that cluster/regroup.py's `Regrouper` drives on a real
cluster (cluster/member.py's `ClusterMember` does them with tensors), so the simulator reuses the
real drop plan (`plan_drop`, Fig. 6), pool split and restore plan unchanged:

    manifest()       the running requests that hold KV, with their block tables
    reweigh(r)       the instance holds its stage of the new layout and reports its KV blocks:
                     what the device leaves after the embeddings and head (never dropped), its
                     stage's layers and the activation reserve, in blocks of its stage's layers
                     (§4.1's remap: a dropped layer's bytes become KV). Layers it lacks (a
                     restore, §4.4) were pulled in the background while it served
                     (`background_restore`), or are pulled now while it waits.
    allocate(p)      a new paged pool of `p` blocks (its replica's capacity when alone); the
                     running requests keep as many blocks as they held
    exchange(m)      the K/V of every layer whose holder changed crosses the link (§4.2); a
                     request stalls until its own K/V is in, the others keep running

Time. Every involved instance first finishes its current step: the change starts at the latest
of their clocks. Transfers run at the link's rate, shared by the transfers leaving or entering
the same GPU; §4.2's coordination gives activations priority, so the exchange does not slow
the pipeline, and its chunking is not modelled (a request waits for its last byte).
`remap` (sim/cluster.py's ClusterConfig) prices how freed weight memory becomes KV: "in_place",
the paper's cuMemMap remap (§4.1: "we extend the memory for KVCache by mapping the tail of the
KVCache memory to the freed physical memory"), costs nothing and KV that stays is not copied;
"host_staged", nanoserve's real cluster, stops each instance while every block it holds goes to
host memory over PCIe (`reweigh`) and while what stays comes back (`exchange`).

A step in a group (`StagePipeline`, §4.3). As in vLLM's pipeline-parallel virtual engines, each
member schedules its own batch once its previous batch has come back, and the batch (or the
micro-batches its policy cut it into) runs stage after stage: a stage starts a micro-batch when
its GPU is free and the previous stage's activations have arrived over the link. That is
`sched.kunserve.pipeline_time`'s recurrence, carried across the members' steps, with each
stage priced by the roofline for its own layers (only the last stage runs the LM head). A
lone instance is a pipeline of one stage, and then costs exactly `Roofline.iteration_seconds`.
(nanoserve's own GroupExecutor, cluster/group.py, steps the members in lockstep instead; both
papers' systems build on vLLM's engines, so the simulator follows those by default, and
sim/cluster.py's `ClusterConfig.stepping` prices the lockstep.) KunServe's members
cut each step into cost-balanced micro-batches (`SimMember.schedule_for_layout`); vLLM (PP)'s
run each member's batch as one.
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence

from nanoserve.cluster.drop_plan import Group
from nanoserve.cluster.group import GroupLayout, lookahead_tokens, member_microbatches, pool_seq_limit
from nanoserve.cluster.member import Manifest, Relayout, reserve_manifest
from nanoserve.engine import Engine
from nanoserve.memory.blocks import BlockPool
from nanoserve.memory.host import HostKVStore
from nanoserve.memory.manager import PagedKV
from nanoserve.parallel.pipeline import split_microbatches
from nanoserve.request import Request
from nanoserve.sched.output import SchedulerOutput
from nanoserve.sim.executor import SimExecutor, VirtualClock
from nanoserve.sim.models import BYTES, ModelCost
from nanoserve.sim.roofline import Roofline
from nanoserve.sim.simulation import ACTIVATION_RESERVE, SimConfig


class StagePipeline:
    """The stages of one group, `stages[k]` on the GPU of its k-th member, and when each GPU is
    next free."""

    def __init__(self, roofline: Roofline, stages: Sequence[range], link: str, free_at: Sequence[float]):
        last = len(stages) - 1
        self.stages = [Roofline(roofline.gpu, roofline.model, layers=len(s), last_stage=k == last)
                       for k, s in enumerate(stages)]
        self.free = list(free_at)
        self.busy = [0.0] * len(stages)  # seconds each stage computed
        self.link = link
        self.spans: list[tuple[float, float]] = []  # (first stage starts, last leaves) per `run`

    def occupied_seconds(self) -> float:
        """Seconds some micro-batch was in the pipeline (the union of the runs' spans): the time
        a bubble ratio is measured over (idle periods with no work in the pipe are not bubbles)."""
        total, end = 0.0, -math.inf
        for start, stop in sorted(self.spans):
            if stop > end:
                total += stop - max(start, end)
                end = stop
        return total


    def run(self, microbatches: Sequence[tuple[list[tuple[int, int]], int]], start: float) -> float:
        """Push (batch, sampled rows) micro-batches, all ready at `start`, through the stages in
        order; returns when the last leaves the last stage."""
        gpu, hidden = self.stages[0].gpu, self.stages[0].model.hidden_size
        done, first = start, max(start, self.free[0])
        for batch, rows in microbatches:
            ready = start
            for k, stage in enumerate(self.stages):
                seconds = stage.num_layers * stage.layer_seconds(batch) + stage.head_seconds(rows)
                self.free[k] = max(self.free[k], ready) + seconds
                self.busy[k] += seconds
                ready = self.free[k]
                if k + 1 < len(self.stages):  # the activations go to the next stage's GPU
                    ready += gpu.link_seconds(sum(c for _, c in batch) * hidden * BYTES, self.link)
            done = ready
        if microbatches:
            self.spans.append((first, done))
        return done


class PipelineExecutor(SimExecutor):
    """`SimExecutor` whose forward pass runs through its instance's `StagePipeline`; the clock
    advances until the step's last micro-batch is out (waits for busy stages included)."""

    cost: Roofline  # `__init__` takes a roofline, never a fitted CostModel

    def __init__(self, clock: VirtualClock, roofline: Roofline, output_lens: Mapping[str, int],
                 pipeline: StagePipeline, host_store: HostKVStore | None = None, layerwise_copies: bool = False,
                 token_count_budget: int | None = None):
        """`host_store` and `layerwise_copies` as for `SimExecutor` (a swapping baseline's
        instance files its copies in its manager's store). `token_count_budget`: in a pipeline,
        a step the policy did not cut runs as token-count micro-batches of at most this budget
        / m tokens (m = `member_microbatches`, KunServe's cut; Sarathi-Serve's micro-batch
        budget, KunServe's Fig. 17 (a)); None: as one (vLLM's virtual engines, where each
        engine's step is one micro-batch)."""
        super().__init__(clock, roofline, output_lens, host_store=host_store, layerwise_copies=layerwise_copies)
        self.pipeline = pipeline
        self.token_count_budget = token_count_budget

    def run_on(self, pipeline: StagePipeline) -> None:
        """Run later steps through `pipeline`: the instance joined a group, or left one."""
        self.pipeline = pipeline

    def forward_seconds(self, batch: SchedulerOutput, follows_step: bool = False) -> float:
        # (follows_step never hides host work here: asynchronous scheduling is refused for KunServe.)
        # One stage runs a step as one forward: micro-batches only pay off between stages.
        stages = len(self.pipeline.stages)
        parts = batch.microbatches if batch.microbatches and stages > 1 else [batch.chunks]
        if self.token_count_budget and stages > 1 and not batch.microbatches:
            per_microbatch = max(1, self.token_count_budget // member_microbatches(stages))
            parts = split_microbatches(batch.chunks, -(-batch.num_tokens // per_microbatch))
        work = [([(c.start, c.num_tokens) for c in part], sum(c.samples for c in part)) for part in parts if part]
        # The engine's per-step CPU work (scheduling, input preparation, sampling) precedes stage 0.
        start = self.clock.now + self.cost.gpu.efficiency.iteration_overhead_s
        return self.pipeline.run(work, start) - self.clock.now


def bubble_ratio(pipelines: Sequence[StagePipeline]) -> float | None:
    """§5.3's "bubble time (defined as the ratio of idle GPU cycles)" over `pipelines` while they
    had work: 1 - (their stages' busy seconds) / (stages x occupied seconds); None if none ran."""
    span = sum(p.occupied_seconds() * len(p.stages) for p in pipelines)
    return 1.0 - sum(sum(p.busy) for p in pipelines) / span if span > 0 else None


class SimMember:
    """One instance: a real engine (scheduler + KV manager) on its own clock, and its part of a
    layout change. `peers` is every member of the cluster, by id (this one included)."""

    def __init__(self, instance_id: int, engine: Engine, executor: PipelineExecutor, clock: VirtualClock,
                 config: SimConfig, link: str, peers: Mapping[int, SimMember], seqs_follow_pool: bool = True,
                 host_staged: bool = False):
        """`host_staged`: a layout change copies every live block to host memory and back what
        stays (`ClusterConfig.remap`), as nanoserve's real cluster does; else the paper's remap."""
        self.id, self.engine, self.executor, self.clock = instance_id, engine, executor, clock
        self.roofline, self.link, self.peers = executor.cost, link, peers
        self.cost = ModelCost(self.roofline.model)
        self.device_bytes = self.roofline.gpu.memory_bytes * config.gpu_memory_utilization
        self.layout = GroupLayout.of(Group.replica(instance_id, self.roofline.model.num_layers))
        self.replica_blocks = engine.kv.num_blocks
        # max_num_seqs scales with the pool a layout change gives (`seq_limit`), or stays.
        self.replica_max_num_seqs, self.seqs_follow_pool = config.max_num_seqs, seqs_follow_pool
        # A capacity fixed by the experiment (kv_bytes, kv_blocks) is not what the weights leave,
        # so a drop could not say what it frees: such instances serve only as replicas.
        self.fixed_capacity = config.kv_bytes is not None or config.kv_blocks is not None
        self.stalled: dict[str, tuple[Request, float]] = {}  # waiting for their K/V: (request, ready at)
        self.pulled_bytes = self.sent_bytes = 0
        self.weights_copied = 0  # pulled by the latest layout change itself (not in the background)
        self.exchange_seconds = 0.0  # summed over changes: the longest stall each caused here
        self.host_staged = host_staged
        self.staged_bytes = 0  # copied to host memory and back by layout changes (`host_staged`)
        self.staging_seconds = 0.0  # the PCIe time those copies stopped this instance for
        self._relayout: Relayout | None = None
        self._phase_start = self._reweighed_at = 0.0
        self.prefetched = False  # the layers a restore needs were pulled in the background
        self.schedule_for_layout()

    # -- what the cluster reads (cluster/instance.py load_of) -------------------------------------
    @property
    def capacity_blocks(self) -> int:
        return self.engine.kv.num_blocks

    # The background restore is modelled by time here (sim/cluster.py `_restore_when_pulled`),
    # not by pages: no block is retired and no page is left to fill.
    retired_free: frozenset[int] = frozenset()
    pull_pages_left = 0
    restore_pulled_bytes = 0

    # -- capacity ---------------------------------------------------------------------------
    def blocks_for(self, layers: range) -> int:
        """KV blocks (of these layers' K and V) the device holds next to these layers' weights."""
        kept = self.cost.weight_bytes - self.cost.layer_bytes * (self.roofline.model.num_layers - len(layers))
        per_block = self.cost.kv_bytes_per_token_per_layer * len(layers) * self.engine.kv.block_size
        return int((self.device_bytes - kept - ACTIVATION_RESERVE) // per_block)

    # -- serving state ----------------------------------------------------------------------
    @property
    def exchanging(self) -> bool:
        return bool(self.stalled)

    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests() or bool(self.stalled)

    def next_time(self) -> float:
        """When this instance can next do something: now if it has requests to schedule, when
        its first stalled request's K/V is in if that is all it has, never if idle."""
        if self.engine.has_unfinished_requests():
            return self.clock.now
        if self.stalled:
            return max(self.clock.now, min(ready for _, ready in self.stalled.values()))
        return math.inf

    def unstall(self) -> None:
        for request_id, (request, ready) in list(self.stalled.items()):
            if ready <= self.clock.now:
                del self.stalled[request_id]
                self.engine.scheduler.resume(request)

    # -- §4.4's restore in the background ----------------------------------------------------
    def missing_layer_bytes(self) -> int:
        return (self.roofline.model.num_layers - len(self.layout.stage_of(self.id))) * self.cost.layer_bytes

    def pull_seconds(self) -> float:
        """How long pulling every layer this instance lacks takes over its link."""
        return self.roofline.gpu.link_seconds(self.missing_layer_bytes(), self.link)

    def prefetch_all_layers(self) -> None:
        """Start pulling the layers it lacks; it goes on serving (the bytes count now)."""
        self.pulled_bytes += self.missing_layer_bytes()
        self.prefetched = True

    def phase(self, kind: str) -> Callable[..., object]:
        """The method that runs the layout-change message `kind`: the four phases of a drop or
        a restore (cluster/member.py's; a restore's background pull is the cluster's here)."""
        phases: dict[str, Callable[..., object]] = {
            "manifest": self.manifest, "reweigh": self.reweigh, "allocate": self.allocate, "exchange": self.exchange}
        return phases[kind]

    # -- phase 1 ----------------------------------------------------------------------------
    def manifest(self) -> Manifest:
        assert not self.stalled, "a layout change started before the previous exchange ended"
        self._phase_start = self.clock.now
        kv = self.engine.kv
        return tuple((r.request_id, tuple(kv.block_table(r))) for r in self.engine.scheduler.running
                     if kv.block_table(r))

    # -- phase 2 ----------------------------------------------------------------------------
    def reweigh(self, relayout: Relayout) -> int:
        if self.fixed_capacity:
            raise ValueError(f"instance {self.id}: a fixed KV capacity cannot change with the layout")
        # Every involved instance finishes its step first; then the layers this one lacks come.
        self.clock.advance_to(max(self.peers[m]._phase_start for m in relayout.members()))
        old, new = relayout.old[self.id].stage_of(self.id), relayout.new[self.id].stage_of(self.id)
        if self.host_staged:  # every block it holds, all its layers, goes to host memory first
            blocks = sum(1 for _ in relayout.staged(self.id))
            self._host_copy(blocks * len(old) * self.cost.kv_bytes_per_token_per_layer * self.engine.kv.block_size)
        pulled = len([layer for layer in new if layer not in old]) * self.cost.layer_bytes
        self.weights_copied = 0
        if self.prefetched and len(new) == self.roofline.model.num_layers:
            self.prefetched = False  # pulled while serving (SimCluster.background_restore)
        else:
            self.clock.advance(self.roofline.gpu.link_seconds(pulled, self.link))
            self.pulled_bytes += pulled
            self.weights_copied = pulled
        self._relayout = relayout
        self._reweighed_at = self.clock.now  # the exchange leaves once every member is here
        return self.blocks_for(new)

    # -- phase 3 ----------------------------------------------------------------------------
    def allocate(self, pools: Mapping[int, int] | None) -> Manifest:
        assert self._relayout is not None
        new, size = self._relayout.new[self.id], self.engine.kv.block_size
        if new.solo:
            blocks = self.replica_blocks
        else:
            assert pools is not None  # a group's members are given their pool sizes
            blocks = pools[self.id]
        kv = PagedKV(BlockPool(blocks, size))
        tables = reserve_manifest(kv, self._relayout.manifests.get(self.id, ()), self.engine.scheduler.running, size)
        self.engine.scheduler.use_kv_manager(kv)
        self.engine.scheduler.limit_sequences(self.seq_limit(blocks))
        self.layout = new
        self.schedule_for_layout()
        return tables

    def seq_limit(self, blocks: int) -> int:
        """max_num_seqs for a pool of `blocks`: the replica's scaled by the pool over the replica's
        (issue 46: the replica's cap of 256 fills ~96% of its KV at BurstGPT's mean lengths, so a
        fixed cap would leave a drop's added KV unused). assumption: the cap follows the KV
        linearly; `seqs_follow_pool=False` keeps the replica's (the rule before)."""
        if not self.seqs_follow_pool:
            return self.replica_max_num_seqs
        return pool_seq_limit(self.replica_max_num_seqs, blocks, self.replica_blocks)

    def schedule_for_layout(self) -> None:
        """KunServe's scheduler (sched/kunserve.py) runs in its pipeline-parallel mode: a
        lookahead over the running and waiting requests, m token budgets deep, cut by its
        balancing (§4.3, Fig. 10-11) into micro-batches of equal cost, as many (m) as the engine
        builder gives a pipeline of this depth (two per stage). In
        a group they enter the stages back to back. Alone, the same FCFS step runs as one
        forward (`PipelineExecutor` ignores the cut on one stage): an instance that dropped
        nothing serves as vLLM does (§4.4: "normal execution cannot simply apply our lookahead
        scheduling"). Its other mode, a step of one lookahead micro-batch, is for one device."""
        stages = len(self.layout.members)
        # §4.3's lookahead over the queue: m micro-batches in flight, each up to a step's budget.
        budget = self.engine.scheduler.config.max_num_batched_tokens
        self.engine.scheduler.use_pipeline(stages, member_microbatches(stages), lookahead_tokens(stages, budget))

    def _host_copy(self, nbytes: int) -> None:
        """Copy `nbytes` of KV between this GPU and host memory, the instance stopped meanwhile
        (the real member copies synchronously, one layer at a time)."""
        seconds = self.roofline.gpu.link_seconds(nbytes, "pcie")
        self.clock.advance(seconds)
        self.staged_bytes += nbytes
        self.staging_seconds += seconds

    # -- phase 4 ----------------------------------------------------------------------------
    def exchange(self, new_manifests: Mapping[int, Manifest], chunk_bytes: int) -> dict[str, int]:
        """Stall this instance's requests until their K/V has crossed; report the bytes sent."""
        relayout, self._relayout = self._relayout, None
        assert relayout is not None
        start = max(self.peers[m]._reweighed_at for m in relayout.members())  # after every pull (and copy out)
        block_layer = self.cost.kv_bytes_per_token_per_layer * self.engine.kv.block_size
        sent: dict[tuple[int, int], int] = defaultdict(int)  # (from, to) -> bytes so far
        last: dict[str, dict[tuple[int, int], int]] = defaultdict(dict)  # own request -> its last byte per pair
        kept = 0
        # Both ends enumerate the same order (Relayout.staged): holder, its old group's owners,
        # their requests; a request is in once its bytes on every pair are.
        for holder in relayout.members():
            held = relayout.old[holder].stage_of(holder)
            for owner in relayout.old[holder].members:
                new = relayout.new[owner]
                for request_id, table in relayout.manifests[owner]:
                    for target, stage in zip(new.members, new.stages):
                        nbytes = len(table) * block_layer * len(range(max(held.start, stage.start),
                                                                      min(held.stop, stage.stop)))
                        if nbytes and target == holder:
                            kept += nbytes if holder == self.id else 0
                        elif nbytes:
                            sent[holder, target] += nbytes
                            if owner == self.id:
                                last[request_id][holder, target] = sent[holder, target]
        if self.host_staged:  # what stays on this GPU comes back from host memory (cluster/member.py `_install`)
            self.clock.advance_to(start)
            self._host_copy(kept)
        out_degree: defaultdict[int, int] = defaultdict(int)
        in_degree: defaultdict[int, int] = defaultdict(int)
        for src, dst in sent:
            out_degree[src] += 1
            in_degree[dst] += 1
        gpu = self.roofline.gpu

        def seconds(pair: tuple[int, int], nbytes: int) -> float:
            return gpu.link_seconds(nbytes * max(out_degree[pair[0]], in_degree[pair[1]]), self.link)

        for request in [r for r in self.engine.scheduler.running if r.request_id in last]:
            ready = start + max(seconds(pair, n) for pair, n in last[request.request_id].items())
            self.engine.scheduler.stall(request)
            self.stalled[request.request_id] = (request, ready)
        if self.stalled:
            self.exchange_seconds += max(ready for _, ready in self.stalled.values()) - start
        mine = sum(n for (src, _), n in sent.items() if src == self.id)
        self.sent_bytes += mine
        return {"sent": mine, "kept": kept, "rounds": int(bool(sent)), "weights_copied": self.weights_copied}
