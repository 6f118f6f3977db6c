"""The simulator's executor (DESIGN.md: "the same Scheduler and memory-manager objects run in the
real engine and in the simulator"): an `Executor` that prices each batch with a cost model and
advances a virtual clock by that much, instead of running the model.

    Engine.step ─► scheduler.schedule()          the real policy and KV manager (it polls the
                                                 host store's ledger: which copies have landed)
                ─► SimExecutor.execute(batch)    copies onto the link, the forward on the clock;
                                                 each sampling request draws a token
                ─► Engine postprocess            the real bookkeeping, timed by the VirtualClock

Costs, by what the batch asks for:
- the forward pass: `Roofline.iteration_seconds` (a named GPU and model), or any `CostModel`
  (the fitted profile of sched/cost_model.py, e.g. this machine's, for sim_fidelity);
- KV copies (swaps, checkpoints, BROS's saved slots, loads back): their tokens' K/V bytes over
  PCIe (moves between device blocks over HBM), on a link of their own.

The link. The runner issues every copy on one copy stream, in order, beside the compute stream
(memory/host.py), so the simulator gives copies one FIFO link with its own timeline: a copy
starts when its step starts or when the link frees, whichever is later, and holds the link for
its duration. Copies never share the link and never overtake each other. A forward waits only
for the copies it needs (`KVCopy.needed_by`, over every copy still on the link, as the runner's
`HostKVStore.wait_for` asks it of the whole ledger: blocking copies, and loads or moves whose
reader is in its batch, even those an earlier step issued as a prefetch); the rest run under it:

    link:     [save a][load b  ][save c        ]       [load d: prefetch for r9]
    compute:  ·····waits········├─ forward n ─────────┤├─ forward n+1 ─────────┤
              ▲ step n          ▲ b lands              ▲ step n+1

Batch n reads b, so forward n starts when b lands (behind a: one link, in order), not when c
does; c, and d (whose reader r9 is not in batch n+1), run under the forwards. Forward n+1 would
wait for what is left of d only if r9 were in its batch.

So a step takes its forward time plus the unfinished part of the copies it needs
(`SimStats.forward_stall_seconds`); the link's own total is `link_busy_seconds`.

Layer by layer (`layerwise_copies`, the real `HostKVStore(layerwise=True)`; BROS §4.1's
"iteration time can be computed as max(T_exec, T_swap)"): a step's copies go on the link as one
layer-major run, its layer l part landing (l + 1) / L of the way through, and each layer of the
forward starts when the previous layer is done and its own part of the needed runs has landed:

    link:     [L0 ][L1 ][L2 ][L3 ]
    compute:   ovh├L0─┤├L1─┤├L2─┤├L3─┤head┤

so a step takes about max(forward, copies) plus one layer's share, not their sum. Each copy is
filed in the host store's ledger (`InflightCopies`) with a probe that says it landed once the
virtual clock reaches its end, so the KV manager's poll at the next step's start learns what
landed exactly as it does with the runner's CUDA events, and holds on to blocks until then.
`next_landing` tells the simulation loop when the next copy lands (a manager may be waiting for a
save before it can resume anything). A step with copies and no chunks issues them and leaves the
clock where it is.

Tokens. A simulated request carries its output length from the workload; the executor samples
a filler token until that many are out and then the EOS token, so the engine stops it exactly as
a model's EOS would ("stop"), and no policy can read the length from `max_tokens`.

Layer-wise preemption (ConServe, conserve.txt §4.3 and §5), as the real `ModelRunner` does it and
with its very `PreemptionFlag`: a pure-offline forward passes a safe point every
`preempt_every_layers` decoder layers (not after the last one). At each, the clock stands at that
layer boundary (the forward's start, after the copies it waits for, then the per-iteration
overhead, then that many layers), the flag's `on_safe_point` runs (the simulation admits the
trace requests that have arrived by then, as the server's engine loop does), and if
`request_preemption()` was called the forward stops there: the clock stays at the safe point
(copies it did not need run on) and `execute` returns `ExecutorOutput(preempted=True)`, which the
engine discards. A request the forward does not consume is dropped when it ends, as in the
runner. Layers are priced one by one only when something can stop the forward (a callback is
installed or a stop is pending): otherwise the forward is one roofline call.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

from nanoserve.config import EngineArgs
from nanoserve.executor import Executor, ExecutorOutput
from nanoserve.memory.copies import ISSUE_ORDER
from nanoserve.memory.host import HostKVStore, KVCopy
from nanoserve.preemption import ForwardPreempted, PreemptionFlag
from nanoserve.sched.cost_model import CostModel, batch_of
from nanoserve.sched.output import SchedulerOutput
from nanoserve.sim.roofline import Roofline
from nanoserve.slo import RequestClass

EOS_TOKEN = 2
FILLER_TOKEN = 7
# Virtual time is a float sum of many durations: a copy whose end the clock reaches by another
# sum may fall a rounding error short of it. A nanosecond is far below any copy's duration, and
# `next_landing` and the landing probe use the same tolerance, so they never disagree.
LANDING_TOLERANCE = 1e-9


@dataclass
class VirtualClock:
    """What the scheduler, the engine and the metrics read as time.monotonic in a simulation."""

    now: float = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"time cannot go back ({seconds} s)")
        self.now += seconds

    def advance_to(self, when: float) -> None:
        self.now = max(self.now, when)


@dataclass
class SimStats:
    steps: int = 0  # executed steps, copies-only ones included
    forwards: int = 0  # steps that ran a forward (stopped ones included)
    busy_seconds: float = 0.0  # forward passes, the stopped ones' layers included
    link_busy_seconds: float = 0.0  # the copies' durations on the link (never two at once)
    forward_stall_seconds: float = 0.0  # forwards' waits for the copies they needed
    discarded_seconds: float = 0.0  # forward time of stopped (layer-wise preempted) forwards
    online_tokens: int = 0  # tokens sampled for online requests


@dataclass(frozen=True)
class LinkSlot:
    """One copy's time on the link. A layer-major slot is its step's whole run: every copy of
    the step has the run's span, and its layer l part lands (l + 1) / L of the way through."""

    copy: KVCopy
    start: float
    end: float
    layer_major: bool = False

    def layer_landed(self, layer: int, num_layers: int) -> float:
        """When the part of this copy that layer `layer` reads has landed."""
        if not self.layer_major:
            return self.end
        return self.start + (layer + 1) / num_layers * (self.end - self.start)


class SimExecutor(Executor):
    def __init__(self, clock: VirtualClock, cost: Roofline | CostModel, output_lens: Mapping[str, int],
                 copy_cost: Roofline | None = None, preempt_every_layers: int = EngineArgs.preempt_every_layers,
                 record_online_gaps: bool = False, host_store: HostKVStore | None = None,
                 layerwise_copies: bool = False, scheduling_time_scale: float | None = None):
        """`output_lens`: request id -> the output length its workload gave it. `copy_cost`
        prices KV copies when `cost` is a fitted CostModel (defaults to `cost` if a Roofline).
        `preempt_every_layers`: the safe-point spacing (the real engine's
        `EngineArgs.preempt_every_layers`, 8 by default as in the paper). `record_online_gaps`:
        keep every online inter-token gap in `online_gaps` (ConServe's per-token TPOT, §2.2).
        `host_store`: the KV manager's (bookkeeping only): every copy is filed in its ledger,
        landing when the virtual clock passes its end. Without one the copies are only priced
        (nobody polls for them). `layerwise_copies`: a step's copies stream layer by layer and a
        forward waits per layer (above); a pipeline stage, or a fitted profile with no model to
        name its layers, waits for whole copies. `scheduling_time_scale`: None prices the host's
        work per step as the cost's flat overhead only; a factor also charges each step the wall
        time its scheduler took to plan it (`SchedulerOutput.plan_seconds`) times the factor."""
        self.clock, self.cost = clock, cost
        self.scheduling_time_scale = scheduling_time_scale
        self.scheduling_seconds = 0.0  # charged so far by `scheduling_time_scale`
        self.plan_wall_seconds = 0.0  # the schedulers' measured planning time, charged or not
        self.output_lens = output_lens
        self.host_store = host_store
        self.online_gaps: list[float] | None = [] if record_online_gaps else None
        self._last_token: dict[str, float] = {}  # online request id -> when its latest token came
        self.copy_cost = copy_cost if copy_cost is not None else (cost if isinstance(cost, Roofline) else None)
        self.stats = SimStats()
        self.link_free = clock.now  # when the link has carried every copy issued so far
        # Copies that may still be on the link, in issue order. One FIFO link: their ends never
        # decrease, so those that landed are always at the front.
        self._on_link: deque[LinkSlot] = deque()
        # The layers a forward walks through: the roofline's, or for a fitted profile (which has no
        # layer breakdown) the model's that `copy_cost` names, its time split evenly among them.
        shape = cost if isinstance(cost, Roofline) else self.copy_cost
        self.preemption = PreemptionFlag(preempt_every_layers, shape.num_layers if shape is not None else 0)
        # As the runner, a pipeline stage is never preemptible: no barrier aligns the stages.
        self._stoppable = shape is not None and shape.layers is None
        self.layerwise = layerwise_copies and self._stoppable
        self._device_free = float("-inf")  # when the last forward ended

    def forward_seconds(self, batch: SchedulerOutput, follows_step: bool = False) -> float:
        """The step's cost; `follows_step`: it starts as the forward before it ends (the roofline
        hides its host work then, under asynchronous scheduling: `Efficiency.host_overlap`)."""
        chunks = batch_of(batch)
        if isinstance(self.cost, Roofline):
            seconds = self.cost.iteration_seconds(chunks, sum(c.samples for c in batch.chunks), follows_step)
        else:
            seconds = self.cost.predict(chunks)
        return seconds + self._scheduling_seconds(batch)

    def _scheduling_seconds(self, batch: SchedulerOutput) -> float:
        """The planning time charged to this step, in series with its forward (the scheduler runs
        on the host before the step's inputs exist): 0 unless `scheduling_time_scale` is set."""
        self.plan_wall_seconds += batch.plan_seconds
        if self.scheduling_time_scale is None:
            return 0.0
        seconds = batch.plan_seconds * self.scheduling_time_scale
        self.scheduling_seconds += seconds
        return seconds

    # -- the link ------------------------------------------------------------------------------
    def copy_duration(self, copy: KVCopy) -> float:
        """Seconds `copy` holds the link. A move stays on the device (HBM); saves and loads cross PCIe."""
        if self.copy_cost is None:
            return 0.0
        return self.copy_cost.kv_copy_seconds(len(copy.src), "hbm" if copy.kind == "move" else "pcie")

    def _landed(self, end: float) -> bool:
        return self.clock.now >= end - LANDING_TOLERANCE

    def issue_copies(self, groups: Iterable[Iterable[KVCopy]]) -> list[LinkSlot]:
        """Queue a step's copy groups on the link at the clock's time, in the runner's order
        (groups in order; within a group saves, then moves, then loads), and file each in the
        host store's ledger."""
        slots = []
        ordered = [copy for group in groups  # stable: issue order within a kind
                   for copy in sorted(group, key=lambda c: ISSUE_ORDER.index(c.kind))]
        if self.layerwise and ordered:  # one layer-major run: every copy lands with its last layer
            start = max(self.clock.now, self.link_free)
            end = start + sum(self.copy_duration(copy) for copy in ordered)
            slots = [LinkSlot(copy, start, end, layer_major=True) for copy in ordered]
            self.link_free = end
            self.stats.link_busy_seconds += end - start
        else:
            for copy in ordered:
                start = max(self.clock.now, self.link_free)
                slot = LinkSlot(copy, start, start + self.copy_duration(copy))
                self.link_free = slot.end
                self.stats.link_busy_seconds += slot.end - slot.start
                slots.append(slot)
        for slot in slots:
            self._on_link.append(slot)
            if self.host_store is not None:
                self.host_store.inflight.issue(slot.copy, partial(self._landed, slot.end))
        return slots

    def on_link(self) -> list[LinkSlot]:
        """Copies still on the link at the clock's time, in issue order."""
        while self._on_link and self._landed(self._on_link[0].end):
            self._on_link.popleft()
        return list(self._on_link)

    def next_landing(self) -> float | None:
        """When the next copy still on the link lands; None when the link is idle."""
        slots = self.on_link()
        return slots[0].end if slots else None

    def needed(self, readers: Iterable[Hashable]) -> list[LinkSlot]:
        """The copies still on the link that a forward over `readers` needs."""
        readers = set(readers)
        return [s for s in self.on_link() if s.copy.needed_by(readers)]

    def needed_until(self, readers: Iterable[Hashable]) -> float:
        """When the last copy a forward over `readers` needs has landed (the clock's time if none
        is still on the link): a forward waiting for whole copies starts then."""
        return max((s.end for s in self.needed(readers)), default=self.clock.now)

    # -- the forward ---------------------------------------------------------------------------
    def request_preemption(self) -> None:
        """Stop the pure-offline forward in flight at its next safe point (ConServe Alg. 2's
        PREEMPTRUNNING); the engine forwards its scheduler's request here, as to the runner."""
        self.preemption.request()

    def on_safe_point(self, callback: Callable[[], None] | None) -> None:
        self.preemption.on_safe_point = callback

    def layer_timing(self, batch: SchedulerOutput, forward_s: float) -> tuple[float, float]:
        """(seconds before the first decoder layer, seconds per layer) of `batch`'s forward.
        The per-iteration overhead (scheduling, input preparation) comes first, so a stopped
        forward pays it; the LM head comes after the last layer, so a stopped one never does."""
        if isinstance(self.cost, Roofline):  # (never overlapped: host_overlap runs no layer-wise forward)
            return self.cost.gpu.efficiency.iteration_overhead_s, self.cost.layer_seconds(batch_of(batch))
        return self.cost.iteration, (forward_s - self.cost.iteration) / self.preemption.num_layers

    def layer_ends(self, batch: SchedulerOutput, forward_start: float, forward_s: float,
                   waits: Sequence[LinkSlot] = ()) -> list[float]:
        """When each decoder layer of the forward starting at `forward_start` is done; with
        `waits` (layer-major copies it reads), layer l starts no earlier than its part lands."""
        before, per_layer = self.layer_timing(batch, forward_s)
        num_layers = self.preemption.num_layers
        if not waits:  # a product, not a running sum: the safe points' exact times
            return [forward_start + before + layers * per_layer for layers in range(1, num_layers + 1)]
        ends, done = [], forward_start + before
        for layer in range(num_layers):
            ready = max((s.layer_landed(layer, num_layers) for s in waits), default=done)
            done = max(done, ready) + per_layer
            ends.append(done)
        return ends

    def _stopped_after(self, layer_ends: list[float], forward_start: float) -> float | None:
        """Walk the safe points of the forward starting at `forward_start` whose layers end at
        `layer_ends`; the seconds it ran if a safe point stopped it, None if it runs to the end."""
        flag = self.preemption
        try:
            for layers_done in range(flag.every, flag.num_layers, flag.every):
                self.clock.advance_to(layer_ends[layers_done - 1])
                flag.safe_point(layers_done)
        except ForwardPreempted:
            return self.clock.now - forward_start
        return None

    def execute(self, batch: SchedulerOutput) -> ExecutorOutput:
        stats, flag = self.stats, self.preemption
        stats.steps += 1
        start = self.clock.now
        self.issue_copies(batch.kv_copies)
        if not batch.chunks:  # copies only: no forward, and the runner leaves the flag alone
            return ExecutorOutput()
        stats.forwards += 1
        # The forward waits for the copies it needs, and only for those (the runner's wait_for):
        # for whole copies before it starts, for layer-major ones layer by layer.
        needed = self.needed(c.request.request_id for c in batch.chunks)
        layer_waits = needed if self.layerwise else []
        forward_start = start if layer_waits else max((s.end for s in needed), default=start)
        self.clock.advance_to(forward_start)
        # priced from the forward's start (a pipeline's stages)
        forward_s = self.forward_seconds(batch, follows_step=forward_start <= self._device_free + LANDING_TOLERANCE)
        stoppable = ((flag.on_safe_point is not None or flag.requested) and self._stoppable
                     and all(c.request.priority is RequestClass.OFFLINE for c in batch.chunks))
        layer_ends = self.layer_ends(batch, forward_start, forward_s, layer_waits) if layer_waits or stoppable else []
        # How much later than forward_s its last layer ends, waiting for its layers' copies.
        layer_stall = layer_ends[-1] - self.layer_ends(batch, forward_start, forward_s)[-1] if layer_waits else 0.0
        stats.forward_stall_seconds += forward_start - start + layer_stall
        # Only a pure-offline batch is preemptible (ConServe's offline batching mode, §4.3).
        if stoppable:
            ran = self._stopped_after(layer_ends, forward_start)
            if ran is not None:
                flag.requested = False  # the clock stays at the safe point; unneeded copies run on
                stats.busy_seconds += ran
                stats.discarded_seconds += ran
                return ExecutorOutput(preempted=True)
        flag.requested = False  # not consumed by this forward: the next schedule serves it
        # One sum from the forward's start, so unstopped runs keep their exact times.
        self.clock.advance_to(forward_start + forward_s + layer_stall)
        self._device_free = self.clock.now
        stats.busy_seconds += forward_s
        out = ExecutorOutput()
        gaps, now = self.online_gaps, self.clock.now
        for chunk in batch.chunks:
            if chunk.samples:
                request = chunk.request
                done = request.num_output_tokens + 1 >= self.output_lens[request.request_id]
                out.sampled[request.request_id] = EOS_TOKEN if done else FILLER_TOKEN
                if request.priority is RequestClass.ONLINE:
                    stats.online_tokens += 1
                    if gaps is not None:
                        last = self._last_token.pop(request.request_id, None)
                        if last is not None:
                            gaps.append(now - last)
                        if not done:
                            self._last_token[request.request_id] = now
        return out
