"""Instances regrouped into one pipeline after a drop (kunserve.txt §3 Fig. 3 (d), §4.1, §4.2):
each member holds a contiguous run of layers, and together they hold one copy of the model.

Who schedules. Every member keeps its own scheduler, its own requests and its own queue, as
vLLM's pipeline-parallel "virtual engines" do: a step runs each member's batch through every
stage, one after another, so the members' batches are the pipeline's micro-batches (§4.3's
lookahead micro-batches, when the policy cuts them, subdivide a member's batch further). Nothing
has to migrate on a drop but KV, and the dispatcher keeps routing to members as before. With
`async_pipeline` the steps stay in flight instead, each stage on a different one
(`GroupExecutor`, `in_flight`).

    member A (stage 0: layers [0, h))         member B (stage 1: layers [h, L))
    schedule A's batch ─┐                  ┌─ schedule B's batch
                        └── exchange step messages ──┘
    stage 0 of A's batch ──── hidden ───► stage 1 of A's batch ── logits ─► A samples
    stage 0 of B's batch ──── hidden ───► stage 1 of B's batch    (B samples its own)

Block ids. Arena block ids are page numbers, and a member's arena has its own layout, so the
same request's KV sits at different blocks on different members. Each member's scheduler keeps
*logical* block ids from a pool of its own (`PagedKV` over a `BlockPool`). Every member that
holds layers for it has carved that many physical blocks out of its arena (one `lut` per
owner: logical id -> physical block), so a block table translates with one lookup per block
and no allocation protocol runs per step. Pools are fixed for the life of the group (§4.1's
drop gives a fixed amount of memory); the member's next load report tells the monitor if it
is throttled again.
"""
from __future__ import annotations

import pickle
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nanoserve.builder import pipeline_microbatches
from nanoserve.cluster.drop_plan import Group
from nanoserve.config import EngineArgs
from nanoserve.executor import Executor, ExecutorOutput
from nanoserve.model.causal_lm import CausalLM
from nanoserve.model.runner import ModelRunner
from nanoserve.model.stages import MissingLayer
from nanoserve.parallel import p2p
from nanoserve.parallel.executor import StepMessage
from nanoserve.parallel.pipeline import run_stage
from nanoserve.sched.output import ScheduledChunk, SchedulerOutput


@dataclass(frozen=True)
class GroupLayout:
    """`members[k]` (an instance id, which is also its rank in the cluster's gloo world) runs
    stage k, the layers `stages[k]`."""

    members: tuple[int, ...]
    stages: tuple[range, ...]

    @classmethod
    def of(cls, group: Group) -> GroupLayout:
        return cls(tuple(group.instances), tuple(group.stages))

    @property
    def solo(self) -> bool:
        return len(self.members) == 1

    def stage_of(self, member: int) -> range:
        return self.stages[self.members.index(member)]

    def holder(self, layer: int) -> int:
        return next(m for m, stage in zip(self.members, self.stages) if layer in stage)


# -- objects over point-to-point links ------------------------------------------------------
def member_microbatches(stages: int) -> int:
    """Micro-batches a member of a `stages`-deep group cuts each step into: what the engine
    builder gives a pipeline of that depth (two per stage)."""
    return max(2, pipeline_microbatches(EngineArgs(pipeline_parallel_size=stages)))


def pool_seq_limit(replica_max_num_seqs: int, blocks: int, replica_blocks: int) -> int:
    """max_num_seqs for a member whose pool is `blocks`: the replica's cap scaled by the pool over
    the replica's (a fixed cap would leave a drop's added KV unused). assumption: linear."""
    return max(1, round(replica_max_num_seqs * blocks / replica_blocks))


def lookahead_tokens(stages: int, budget: int) -> int | None:
    """Tokens a member of a `stages`-deep group looks ahead over each step (§4.3; the
    scheduler's `use_pipeline`): one budget per micro-batch in flight; None alone (one budget)."""
    return member_microbatches(stages) * budget if stages > 1 else None


def exchange_objects(obj: Any, me: int, peers: Sequence[int]) -> dict[int, Any]:
    """Send `obj` to every peer and receive theirs. Every operation is posted before any is
    waited on, so members calling this in any order cannot deadlock."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    sizes = {p: torch.empty(1, dtype=torch.int64) for p in peers}
    works = [dist.isend(size, p) for p in peers] + [dist.irecv(sizes[p], p) for p in peers]
    _wait_all(works)
    received = {p: torch.empty(int(sizes[p]), dtype=torch.uint8) for p in peers}
    works = [dist.isend(payload, p) for p in peers] + [dist.irecv(received[p], p) for p in peers]
    _wait_all(works)
    return {p: pickle.loads(received[p].numpy().tobytes()) for p in peers} | {me: obj}


def _wait_all(works: Sequence[dist.Work | None]) -> None:
    for work in works:
        assert work is not None, "every member is in the default group"
        work.wait()


# -- the model as one stage ----------------------------------------------------------------
class StageModules:
    """Turns a full model into one stage of a group and back, without moving a weight: the
    layers it does not hold become `MissingLayer`s (their parameters are the arena's empty
    tensors after a drop) and a stage before the last skips the final norm."""

    def __init__(self, model: CausalLM):
        self.model = model
        self._saved: dict[tuple[str, int | None], nn.Module] = {}

    def set_stage(self, layers: range, is_last: bool) -> None:
        self.release()
        body = self.model.body()
        for i, layer in enumerate(body.layers):
            if i not in layers:
                self._saved["layers", i] = layer
                body.layers[i] = MissingLayer()
        if not is_last:
            for name in body.LAST_STAGE_ONLY:
                if getattr(body, name) is not None:
                    self._saved[name, None] = getattr(body, name)
                    setattr(body, name, None)

    def release(self) -> None:
        """The whole model again (its weights must be back in place first)."""
        body = self.model.body()
        for (name, index), module in self._saved.items():
            if index is None:
                setattr(body, name, module)
            else:
                body.layers[index] = module
        self._saved.clear()


Work = tuple[int, list[ScheduledChunk]]  # (owner, chunks): one owner's micro-batch on this member's blocks


def translate(chunks: Sequence[ScheduledChunk], lut: Sequence[int]) -> list[ScheduledChunk]:
    """Logical block tables -> this member's physical blocks."""
    return [c._replace(block_table=[lut[b] for b in c.block_table]) for c in chunks]


class GroupExecutor(Executor):
    """One member's executor while it is in a group (see the module docstring). `luts[owner]`
    maps the owner's logical blocks to this member's arena blocks.

    `in_flight` (ours; issue 46 item 5; `EngineArgs.async_pipeline` in a cluster): the group keeps
    steps in flight instead of running each through every stage before the next, as the
    engine's own asynchronous pipeline does (engine.py). The members still meet at every step
    to exchange step messages, so stage k runs, at shared step t, the batches of step t − k
    (a wave), whose activations stage k − 1 sent at step t − 1: every stage works at once, on
    a different step, and no stage waits for another within a step.

        shared step        t          t+1          t+2
        stage 0 (A)     [wave t  ]  [wave t+1]  [wave t+2]
        stage 1 (B)     [wave t-1]  [wave t  ]  [wave t+1]   logits of wave t to their owners

    The engine sees a clocked pipeline (`MicrobatchPipeline.clocked`) `depth` = stages deep:
    it submits a step every time (empty when its policy has nothing to run: the peers' waves
    still pass through), and the step it submitted S − 1 steps earlier has its logits by the
    end of this one. Its scheduler keeps 1/S of the running requests per step and never one
    whose token is in flight, as vLLM's virtual engines do. Activations and logits have gloo
    tags of their own, since both are in flight while the next step's messages pass."""

    HIDDEN_TAG, LOGITS_TAG = 1, 2

    def __init__(self, runner: ModelRunner, layout: GroupLayout, me: int, luts: Mapping[int, Sequence[int]],
                 in_flight: bool = False):
        self.runner, self.layout, self.me, self.luts = runner, layout, me, dict(luts)
        position = layout.members.index(me)
        self.position = position
        self.is_first, self.is_last = position == 0, position == len(layout.members) - 1
        self.prev = None if self.is_first else layout.members[position - 1]
        self.next = None if self.is_last else layout.members[position + 1]
        self.peers = [m for m in layout.members if m != me]
        self.steps = 0  # steps this member took part in (the cluster joins idle members in)
        self.dtype = next(p for p in runner.model.parameters() if p.numel()).dtype  # dropped ones are empty
        self.busy_seconds = 0.0
        # MicrobatchPipeline, when `in_flight`: one step in flight per stage.
        self.clocked = in_flight
        self.depth = len(layout.members) if in_flight else 1
        self._waves: deque[tuple[int, list[Work]]] = deque()  # (step, its work)
        self._own: deque[_OwnStep] = deque()  # this member's steps submitted, oldest first
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []

    def request_preemption(self) -> None:
        self.runner.request_preemption()

    def on_safe_point(self, callback: Callable[[], None] | None) -> None:
        self.runner.on_safe_point(callback)

    def _exchange(self, batch: SchedulerOutput, own: list[list[ScheduledChunk]]) -> list[Work]:
        """Swap step messages with the peers: every owner's micro-batches, (owner, chunks) in
        stage order (the same order on every member), on this member's blocks."""
        if batch.kv_copies:
            raise RuntimeError("a regrouped pipeline runs over the arena, which makes no KV copies")
        messages = exchange_objects(StepMessage.of(batch, own), self.me, self.peers)
        work: list[Work] = []
        for owner in self.layout.members:
            parts = own if owner == self.me else [mb.chunks for mb in messages[owner].outputs()]
            work.extend((owner, translate(part, self.luts[owner])) for part in parts if part)
        return work

    # Under inference mode, as the runner's own steps: the runner's tensors kept between steps (the
    # block-table rows) may have been made in one, and only inference mode may write those.
    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> ExecutorOutput:
        self.steps += 1
        runner, cfg = self.runner, self.runner.model_config
        own = batch.microbatches or [batch.chunks]
        work = self._exchange(batch, own)
        sends: list[tuple[dist.Work, torch.Tensor]] = []
        kept: list[torch.Tensor] = []  # logits of this member's own rows (when it runs the last stage)
        sampling: list = []
        dtype = self.dtype
        for owner, chunks in work:
            prepared = runner.prepare(SchedulerOutput(chunks))
            if owner == self.me:
                sampling.extend(c.request for c in chunks if c.samples)
            hidden, begin = run_stage(runner, prepared, self.prev, dtype)
            if not self.is_last:
                assert self.next is not None  # set for every stage but the last
                sends.append(p2p.isend(hidden, self.next))
            elif prepared.sample_rows:
                logits = runner.model.compute_logits(prepared.sampled(hidden)).contiguous()
                if owner == self.me:
                    kept.append(logits)
                else:
                    sends.append(p2p.isend(logits, owner))
            self.busy_seconds += time.perf_counter() - begin
        out = ExecutorOutput()
        if sampling:
            if not self.is_last:
                for chunks in own:  # the last stage sends them in micro-batch order
                    rows = sum(c.samples for c in chunks)
                    if rows:
                        kept.append(torch.empty(rows, cfg.vocab_size, dtype=dtype, device=runner.device))
                        p2p.recv(kept[-1], self.layout.members[-1])
            out = runner.sample(sampling, torch.cat(kept))
        for handle, _ in sends:
            handle.wait()
        return out

    # -- MicrobatchPipeline, with steps in flight (`in_flight`) -----------------------------------
    @torch.inference_mode()
    def submit(self, batch: SchedulerOutput) -> None:
        """One shared step: exchange step messages, queue every owner's batches as this step's
        wave, then run this stage over the wave of `position` steps ago."""
        self.steps += 1
        own = batch.microbatches or [batch.chunks]
        work = self._exchange(batch, own)
        self._own.append(_OwnStep(self.steps, [c.request for part in own for c in part if c.samples],
                                  [sum(c.samples for c in part) for part in own]))
        self._waves.append((self.steps, work))
        self._sends = [s for s in self._sends if not s[0].is_completed()]
        if len(self._waves) > self.position:
            self._run_wave(*self._waves.popleft())

    def _run_wave(self, step: int, work: list[Work]) -> None:
        runner, dtype = self.runner, self.dtype
        for owner, chunks in work:
            prepared = runner.prepare(SchedulerOutput(chunks))
            hidden, begin = run_stage(runner, prepared, self.prev, dtype, tag=self.HIDDEN_TAG)
            if not self.is_last:
                assert self.next is not None  # set for every stage but the last
                self._sends.append(p2p.isend(hidden, self.next, tag=self.HIDDEN_TAG))
            elif prepared.sample_rows:
                logits = runner.model.compute_logits(prepared.sampled(hidden)).contiguous()
                if owner == self.me:
                    next(o for o in self._own if o.step == step).logits.append(logits)
                else:
                    self._sends.append(p2p.isend(logits, owner, tag=self.LOGITS_TAG))
            self.busy_seconds += time.perf_counter() - begin

    @torch.inference_mode()
    def collect(self) -> ExecutorOutput:
        """The oldest own step's tokens: its wave left the last stage during the latest shared
        step at the latest (the engine collects once `depth` steps are in flight)."""
        step = self._own.popleft()
        if not step.requests:
            return ExecutorOutput()
        logits = step.logits
        if not self.is_last:  # the last stage sends them in micro-batch order
            cfg = self.runner.model_config
            for rows in step.rows:
                if rows:
                    logits.append(torch.empty(rows, cfg.vocab_size, dtype=self.dtype, device=self.runner.device))
                    p2p.recv(logits[-1], self.layout.members[-1], tag=self.LOGITS_TAG)
        return self.runner.sample(step.requests, torch.cat(logits))

    def discard_in_flight(self) -> None:
        self._own.clear()
        self._waves.clear()
        self._sends = []


@dataclass
class _OwnStep:
    """A step this member submitted to its group with steps in flight: its sampling requests,
    the sampling rows of each of its micro-batches, and (on the last stage) their logits."""

    step: int
    requests: list
    rows: list[int]
    logits: list[torch.Tensor] = field(default_factory=list)
