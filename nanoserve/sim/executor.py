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

Tokens. A simulated request carries its output length from the workload; the executor samples
a filler token until that many are out and then the EOS token, so the engine stops it exactly as
a model's EOS would ("stop"), and no policy can read the length from `max_tokens`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from nanoserve.memory.host import KVCopy
from nanoserve.model.runner import ExecutorOutput
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
    busy_seconds: float = 0.0  # forward passes
    copy_seconds: float = 0.0  # KV copies


class SimExecutor:
    def __init__(self, clock: VirtualClock, cost: Roofline | CostModel, output_lens: Mapping[str, int],
                 copy_cost: Roofline | None = None):
        """`output_lens`: request id -> the output length its workload gave it. `copy_cost`
        prices KV copies when `cost` is a fitted CostModel (defaults to `cost` if a Roofline)."""
        self.clock, self.cost = clock, cost
        self.output_lens = output_lens
        self.copy_cost = copy_cost if copy_cost is not None else (cost if isinstance(cost, Roofline) else None)
        self.stats = SimStats()

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

    def execute(self, batch: SchedulerOutput) -> ExecutorOutput:
        copy_s = self.copy_seconds(batch.kv_copies)
        forward_s = self.forward_seconds(batch) if batch.chunks else 0.0
        self.clock.advance(copy_s + forward_s)
        stats = self.stats
        stats.steps += 1
        stats.busy_seconds += forward_s
        stats.copy_seconds += copy_s
        out = ExecutorOutput()
        for chunk in batch.chunks:
            if chunk.samples:
                request = chunk.request
                done = request.num_output_tokens + 1 >= self.output_lens[request.request_id]
                out.sampled[request.request_id] = EOS_TOKEN if done else FILLER_TOKEN
        return out
