"""The simulator's executor (DESIGN.md: "the same Scheduler and memory-manager objects run in the
real engine and in the simulator"): an `Executor` that prices each batch with a cost model and
advances a virtual clock by that much, instead of running the model.

    Engine.step ─► scheduler.schedule()          the real policy and KV manager
                ─► SimExecutor.execute(batch)    cost(batch) seconds pass on the VirtualClock;
                                                 each sampling request draws a token
                ─► Engine postprocess            the real bookkeeping, timed by the VirtualClock

Costs, by what the batch asks for:
- the forward pass: `Roofline.iteration_seconds` (a named GPU and model), or any `CostModel`
  (the fitted profile of sched/cost_model.py, e.g. this machine's, for sim_fidelity);
- KV copies (swaps, checkpoints, BROS's saved slots, loads back): their tokens' K/V bytes over
  PCIe (moves between device blocks over HBM). nanoserve's runner finishes a step's copies
  before its forward (`ModelRunner.apply_kv_copies` fences them), so they add to the step.
  `overlap_copies` is a what-if beyond nanoserve: copies beside the forward (ConServe §4.4's
  asynchronous I/O), the step taking the longer of the two.

Tokens. A simulated request carries its output length from the workload; the executor samples
a filler token until that many are out and then the EOS token, so the engine stops it exactly as
a model's EOS would ("stop"), and no policy can read the length from `max_tokens`.

Layer-wise preemption (ConServe, conserve.txt §4.3 and §5), as the real `ModelRunner` does it and
with its very `PreemptionFlag`: a pure-offline forward passes a safe point every
`preempt_every_layers` decoder layers (not after the last one). At each, the clock stands at that
layer boundary (the copies, the per-iteration overhead, then that many layers), the flag's
`on_safe_point` runs (the simulation admits the trace requests that have arrived by then, as the
server's engine loop does), and if `request_preemption()` was called the forward stops there:
the clock stays at the safe point and `execute` returns `ExecutorOutput(preempted=True)`, which
the engine discards. A request the forward does not consume is dropped when it ends, as in the
runner. Layers are priced one by one only when something can stop the forward (a callback is
installed or a stop is pending): otherwise the forward is one roofline call, as before.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from nanoserve.memory.host import KVCopy
from nanoserve.model.runner import ExecutorOutput, ForwardPreempted, PreemptionFlag
from nanoserve.sched.base import SchedulerOutput
from nanoserve.sched.cost_model import CostModel, batch_of
from nanoserve.sim.roofline import Roofline

EOS_TOKEN = 2
FILLER_TOKEN = 7


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
    steps: int = 0
    busy_seconds: float = 0.0  # forward passes, the stopped ones' layers included
    copy_seconds: float = 0.0  # KV copies
    discarded_seconds: float = 0.0  # forward time of stopped (layer-wise preempted) forwards
    online_tokens: int = 0  # tokens sampled for online requests


class SimExecutor:
    def __init__(self, clock: VirtualClock, cost: Roofline | CostModel, output_lens: Mapping[str, int],
                 copy_cost: Roofline | None = None, preempt_every_layers: int = 8, overlap_copies: bool = False,
                 record_online_gaps: bool = False):
        """`output_lens`: request id -> the output length its workload gave it. `copy_cost`
        prices KV copies when `cost` is a fitted CostModel (defaults to `cost` if a Roofline).
        `preempt_every_layers`: the safe-point spacing (the real engine's
        `EngineArgs.preempt_every_layers`, 8 by default as in the paper). `overlap_copies`: a
        what-if, not nanoserve's runner: copies run beside the forward (ConServe §4.4's
        asynchronous I/O), so a step takes the longer of the two. `record_online_gaps`: keep
        every online inter-token gap in `online_gaps` (ConServe's per-token TPOT, §2.2)."""
        self.clock, self.cost = clock, cost
        self.output_lens = output_lens
        self.overlap_copies = overlap_copies
        self.online_gaps: list[float] | None = [] if record_online_gaps else None
        self._last_token: dict[str, float] = {}  # online request id -> when its latest token came
        self.copy_cost = copy_cost if copy_cost is not None else (cost if isinstance(cost, Roofline) else None)
        self.stats = SimStats()
        # The layers a forward walks through: the roofline's, or for a fitted profile (which has no
        # layer breakdown) the model's that `copy_cost` names, its time split evenly among them.
        shape = cost if isinstance(cost, Roofline) else self.copy_cost
        self.preemption = PreemptionFlag(preempt_every_layers, shape.num_layers if shape is not None else 0)
        # As the runner, a pipeline stage is never preemptible: no barrier aligns the stages.
        self._stoppable = shape is not None and shape.layers is None

    def forward_seconds(self, batch: SchedulerOutput) -> float:
        chunks = batch_of(batch)
        if isinstance(self.cost, Roofline):
            return self.cost.iteration_seconds(chunks, sum(c.samples for c in batch.chunks))
        return self.cost.predict(chunks)

    def copy_seconds(self, groups: list[list[KVCopy]]) -> float:
        if self.copy_cost is None:
            return 0.0
        # A move stays on the device; saves and loads cross PCIe.
        return sum(self.copy_cost.kv_copy_seconds(len(copy.src), "hbm" if copy.kind == "move" else "pcie")
                   for group in groups for copy in group)

    def request_preemption(self) -> None:
        """Stop the pure-offline forward in flight at its next safe point (ConServe Alg. 2's
        PREEMPTRUNNING); the engine forwards its scheduler's request here, as to the runner."""
        self.preemption.request()

    def layer_timing(self, batch: SchedulerOutput, forward_s: float) -> tuple[float, float]:
        """(seconds before the first decoder layer, seconds per layer) of `batch`'s forward.
        The per-iteration overhead (scheduling, input preparation) comes first, so a stopped
        forward pays it; the LM head comes after the last layer, so a stopped one never does."""
        if isinstance(self.cost, Roofline):
            return self.cost.gpu.efficiency.iteration_overhead_s, self.cost.layer_seconds(batch_of(batch))
        return self.cost.iteration, (forward_s - self.cost.iteration) / self.preemption.num_layers

    def _stopped_after(self, batch: SchedulerOutput, forward_start: float, forward_s: float) -> float | None:
        """Walk the safe points of the forward starting at `forward_start`; the seconds it ran if
        a safe point stopped it, None if it runs to the end."""
        flag = self.preemption
        before, per_layer = self.layer_timing(batch, forward_s)
        try:
            for layers_done in range(flag.every, flag.num_layers, flag.every):
                self.clock.advance_to(forward_start + before + layers_done * per_layer)
                flag.safe_point(layers_done)
        except ForwardPreempted:
            return self.clock.now - forward_start
        return None

    def execute(self, batch: SchedulerOutput) -> ExecutorOutput:
        stats, flag = self.stats, self.preemption
        stats.steps += 1
        start = self.clock.now
        copy_s = self.copy_seconds(batch.kv_copies)
        stats.copy_seconds += copy_s
        if not batch.chunks:  # copies only: no forward, and the runner leaves the flag alone
            self.clock.advance(copy_s)
            return ExecutorOutput()
        forward_s = self.forward_seconds(batch)
        forward_start = start if self.overlap_copies else start + copy_s
        # Only a pure-offline batch is preemptible (ConServe's offline batching mode, §4.3).
        if ((flag.on_safe_point is not None or flag.requested) and self._stoppable
                and all(c.request.priority == "offline" for c in batch.chunks)):
            ran = self._stopped_after(batch, forward_start, forward_s)
            if ran is not None:
                flag.requested = False
                self.clock.advance_to(start + copy_s)  # overlapped copies still finish first
                stats.busy_seconds += ran
                stats.discarded_seconds += ran
                return ExecutorOutput(preempted=True)
        flag.requested = False  # not consumed by this forward: the next schedule serves it
        # The same sum as before layer-wise preemption, so unstopped runs keep their exact times.
        self.clock.advance_to(start + (max(copy_s, forward_s) if self.overlap_copies else copy_s + forward_s))
        stats.busy_seconds += forward_s
        out = ExecutorOutput()
        gaps, now = self.online_gaps, self.clock.now
        for chunk in batch.chunks:
            if chunk.samples:
                request = chunk.request
                done = request.num_output_tokens + 1 >= self.output_lens[request.request_id]
                out.sampled[request.request_id] = EOS_TOKEN if done else FILLER_TOKEN
                if request.priority == "online":
                    stats.online_tokens += 1
                    if gaps is not None:
                        last = self._last_token.pop(request.request_id, None)
                        if last is not None:
                            gaps.append(now - last)
                        if not done:
                            self._last_token[request.request_id] = now
        return out
