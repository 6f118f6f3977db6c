"""Pipeline parallelism: consecutive layer ranges on consecutive ranks, activations sent between
them point to point, each stage keeping the KV cache of its own layers only.

    rank 0 (stage 0: embeddings, layers [0, a))  ──h──►  rank 1 (layers [a, b))  ──h──► ...
         ▲                                                                             │
         └───────────────── logits of the sampling rows ◄── last stage (norm, LM head) ┘

A step's batch is cut into micro-batches (`split_microbatches`), and every stage runs them in
order: while stage 1 works on micro-batch k, stage 0 already runs k+1. In-order processing is
also what makes cutting a prompt chunk across micro-batches safe: its later piece reaches each
layer after the earlier piece has written its K/V there. A synchronous step ends when the last
micro-batch leaves the last stage, so each step pays the fill and drain bubble, (S − 1) / (m +
S − 1) of the stage-time with m equal micro-batches; unequal ones add more (Fig. 8 of
KunServe). The asynchronous pipeline (engine.py) keeps micro-batches in flight across steps
instead, each step one micro-batch; the same in-order rule makes that safe. The scheduler
decides the cut where it can (`SchedulerOutput.microbatches`:
KunServe's cost-balanced lookahead, §4.3); otherwise it is by token count, as Sarathi-Serve and
vLLM cut, into `EngineArgs.pipeline_microbatches` (default 2 per stage).

Which layers a rank holds, and cutting a model down to them, is the model's side
(model/stages.py); this module runs the stages.
"""
from __future__ import annotations

import time
from collections import deque

import torch
import torch.distributed as dist

from nanoserve.config import Topology
from nanoserve.executor import ExecutorOutput
from nanoserve.model.runner import ModelRunner, PreparedBatch
from nanoserve.parallel import p2p
from nanoserve.sched.output import ScheduledChunk, SchedulerOutput


def split_microbatches(chunks: list[ScheduledChunk], count: int) -> list[list[ScheduledChunk]]:
    """Token-count chunking: `count` micro-batches of as equal token counts as possible, in
    order, cutting a chunk where a boundary falls inside it (only its last piece samples)."""
    total = sum(c.num_tokens for c in chunks)
    count = max(1, min(count, total))
    bounds = [total * (k + 1) // count for k in range(count)]  # cumulative token targets
    microbatches: list[list[ScheduledChunk]] = [[] for _ in range(count)]
    done, k = 0, 0
    for chunk in chunks:
        start, left = chunk.start, chunk.num_tokens
        while left:
            while bounds[k] <= done:
                k += 1
            take = min(left, bounds[k] - done)
            microbatches[k].append(chunk._replace(start=start, num_tokens=take))
            start, left, done = start + take, left - take, done + take
    return [mb for mb in microbatches if mb]


def run_stage(runner: ModelRunner, prepared: PreparedBatch, prev: int | None,
              dtype: torch.dtype, tag: int = 0) -> tuple[torch.Tensor, float]:
    """This stage's layers over one micro-batch: from the tokens on the first stage (`prev` None),
    else from the activations rank `prev` sends. Returns the hidden states and when computing
    began: the wait for activations is not busy time."""
    if prev is None:
        begin = time.perf_counter()
        return runner.run_model(prepared), begin
    hidden = torch.empty(len(prepared.positions), runner.model_config.hidden_size, dtype=dtype, device=runner.device)
    p2p.recv(hidden, src=prev, tag=tag)
    begin = time.perf_counter()
    return runner.run_model(prepared, hidden=hidden), begin


class PipelineStage:
    """One rank's part of a pipelined step: for each micro-batch in order, take the activations
    from the previous stage (or embed the tokens), run this stage's layers, pass them on (or,
    on the last stage, send the sampling rows' logits to rank 0). Sends are asynchronous, so a
    stage starts its next micro-batch while the next stage works on this one.

    `start` runs this rank's part and returns; rank 0 then takes each micro-batch's logits with
    `finish`, one micro-batch at a time, in order: right away for a synchronous step (`run`),
    or while later micro-batches are already in flight (the engine's asynchronous pipeline).
    The logits come back over a group of their own (`returns`), apart from the activations.
    Over NCCL, point-to-point operations between one pair of ranks run in issue order on one
    stream, so with two stages on one group rank 0's queue is [send h1, send h2, ..., recv l1]
    and rank 1's [recv h1, send l1, recv h2, ...]: rank 1's send l1 waits for rank 0's recv l1,
    behind send h2, which waits for rank 1's recv h2, behind send l1, a cycle broken only while
    h2 fits NCCL's buffer (~4 MiB: 1k tokens of a 2k-wide bf16 model). Two groups keep the two
    directions apart (over gloo, tags already would)."""

    def __init__(self, runner: ModelRunner, rank: int, topology: Topology):
        self.runner, self.rank = runner, rank
        tp, stages = topology.tensor_parallel_size, topology.pipeline_parallel_size
        stage = topology.stage_of(rank)
        self.is_first, self.is_last = stage == 0, stage == stages - 1
        self.prev, self.next = rank - tp, rank + tp
        self.last_stage_leader = (stages - 1) * tp  # its tensor-parallel rank 0 sends the logits
        # Every rank creates the group (new_group is collective), in the same order: one stage
        # per rank, built right after the runner.
        self.returns = dist.new_group([0, self.last_stage_leader]) if stages > 1 else None
        self.dtype = next(runner.model.parameters()).dtype
        self.busy_seconds = 0.0  # computing, not waiting for activations
        self.span_seconds = 0.0  # rank 0: time with a micro-batch in flight
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []  # kept alive until they complete
        self._pending: deque[list] = deque()  # rank 0: each started micro-batch's sampling requests
        self._in_flight_since = 0.0
        self.most_in_flight = 0  # rank 0: the most steps `submit` had in flight at once

    @property
    def in_flight(self) -> int:
        """Rank 0: micro-batches started whose logits it has not taken yet."""
        return len(self._pending)

    def start(self, microbatches: list[SchedulerOutput]) -> list[list]:
        """Run this stage over the micro-batches, in order, and return without waiting for any
        send. Returns each micro-batch's sampling requests (rank 0 queues them for `finish`)."""
        runner = self.runner
        self._sends = [s for s in self._sends if not s[0].is_completed()]
        if self.rank == 0 and not self._pending:
            self._in_flight_since = time.perf_counter()
        # Each stage, for its own layers; the forward of every micro-batch follows, so all their
        # requests are this step's readers.
        runner.apply_kv_copies(microbatches[0].kv_copies, microbatches[0].landed_copies,
                               (c.request.request_id for mb in microbatches for c in mb.chunks))
        sampling: list[list] = []
        for mb in microbatches:
            if not mb.chunks:  # a copies-only step: nothing to forward
                continue
            prepared = runner.prepare(mb)
            sampling.append([c.request for c in mb.chunks if c.samples])
            hidden, begin = run_stage(runner, prepared, None if self.is_first else self.prev, self.dtype)
            if not self.is_last:
                self._sends.append(p2p.isend(hidden, self.next))
            elif prepared.sample_rows:
                logits = runner.model.compute_logits(prepared.sampled(hidden)).contiguous()
                if runner.tp.rank == 0:
                    self._sends.append(p2p.isend(logits, 0, group=self.returns))
            self.busy_seconds += time.perf_counter() - begin
        return sampling

    def submit(self, microbatches: list[SchedulerOutput]) -> None:
        """Rank 0: start one step; its logits are taken later by one `finish`."""
        self._pending.append([r for group in self.start(microbatches) for r in group])
        self.most_in_flight = max(self.most_in_flight, len(self._pending))

    def finish(self) -> ExecutorOutput:
        """Rank 0: the oldest pending step's logits (waiting for them), sampled."""
        requests = self._pending.popleft()
        out = ExecutorOutput()
        if requests:
            logits = torch.empty(len(requests), self.runner.model_config.vocab_size, dtype=self.dtype,
                                 device=self.runner.device)
            p2p.recv(logits, src=self.last_stage_leader, group=self.returns)
            out = self.runner.sample(requests, logits)
        if not self._pending:
            self.span_seconds += time.perf_counter() - self._in_flight_since
            for work, _ in self._sends:  # everything sent reached the next stage before its logits came
                work.wait()
            self._sends = []
        return out

    def run(self, microbatches: list[SchedulerOutput]) -> ExecutorOutput:
        """A synchronous step: every micro-batch through every stage, then (rank 0) the tokens."""
        sampling = self.start(microbatches)
        if self.rank != 0:
            return ExecutorOutput()
        self._pending.extend(sampling)
        out = ExecutorOutput()
        for _ in sampling:  # the last stage sends them in micro-batch order
            step = self.finish()
            out.sampled.update(step.sampled)
            out.logprobs.update(step.logprobs)
        return out
