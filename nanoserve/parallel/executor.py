"""Rank 0 schedules, every rank executes: how a step reaches the tensor-parallel workers.

    rank 0 (the engine's process)              ranks 1..N-1 (worker processes)
    scheduler.schedule() ─► StepMessage ──broadcast──► StepMessage
    runner.execute(batch)   ◄── all-reduces, all-gathers ──►  runner.execute(batch)
    samples the tokens                          (compute their shards, sample nothing)

A `StepMessage` carries only what a runner reads from a batch: per chunk, its new token ids,
position range, block table and direction; and the step's KV copy groups. Workers rebuild a
`SchedulerOutput` from it over `StepRequest`s, stand-ins for requests that hold just those
tokens. Every rank then runs the same forward on its own shard of the weights and of the KV
cache; the collectives inside the model keep the ranks in step, and rank 0 samples from the
gathered logits.

The messages go over a gloo group even when the model's collectives use NCCL: they are small
Python objects, and a gloo broadcast from a dead peer fails instead of hanging. Under pipeline
parallelism they are sent point to point instead, so rank 0 need not wait for a stage still
busy with an earlier micro-batch (channel.py).

With `async_pipeline` the driver is also the engine's `MicrobatchPipeline`: `submit` sends one
micro-batch and runs stage 0 on it, `collect` takes back the oldest one's logits; up to
`depth` (`builder.microbatches_in_flight`: one per stage by default) are in flight.
"""
from __future__ import annotations

import atexit
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch.distributed as dist

from nanoserve.config import Topology
from nanoserve.executor import Executor, ExecutorOutput
from nanoserve.memory.host import KVCopy
from nanoserve.model.runner import ModelRunner
from nanoserve.parallel.channel import StepChannel
from nanoserve.parallel.launch import WorkerPool, stop_driver
from nanoserve.parallel.pipeline import PipelineStage, split_microbatches
from nanoserve.request import Request
from nanoserve.sampling import SamplingParams
from nanoserve.sched.output import ScheduledChunk, SchedulerOutput
from nanoserve.slo import RequestClass


class WorkerFailure(RuntimeError):
    """A worker process died or stopped answering; the engine cannot run steps any more."""


@dataclass(frozen=True)
class ChunkMessage:
    request_id: str
    token_ids: tuple[int, ...]  # the chunk's new tokens: positions [start, start + len)
    start: int
    block_table: tuple[int, ...]
    right_to_left: bool
    samples: bool
    priority: RequestClass  # from Request.priority, already a member (and pickled as one)
    # Prompt logprobs: every rank computes the prompt rows' logits (their gather is collective).
    prompt_logprobs: int | None = None
    num_prompt_tokens: int = 0


def _chunk_message(c: ScheduledChunk) -> ChunkMessage:
    r = c.request
    return ChunkMessage(r.request_id, tuple(r.token_ids[c.start:c.end]), c.start, tuple(c.block_table),
                        c.right_to_left, c.samples, r.priority, r.params.prompt_logprobs, r.num_prompt_tokens)


_NO_PARAMS = SamplingParams()


@dataclass(frozen=True)
class StepMessage:
    """One step: its micro-batches (one without a pipeline), its KV copy groups, and the tickets
    of earlier copies the manager saw land (every rank retires them before reusing their blocks)."""

    microbatches: tuple[tuple[ChunkMessage, ...], ...]
    kv_copies: tuple[tuple[KVCopy, ...], ...] = ()
    landed_copies: tuple[int, ...] = ()

    @classmethod
    def of(cls, batch: SchedulerOutput, microbatches: list[list[ScheduledChunk]] | None = None) -> StepMessage:
        return cls(tuple(tuple(_chunk_message(c) for c in mb) for mb in (microbatches or [batch.chunks])),
                   tuple(tuple(group) for group in batch.kv_copies), tuple(batch.landed_copies))

    def outputs(self) -> list[SchedulerOutput]:
        """The micro-batches as batches a runner executes (the first carries the KV copies)."""
        # A `StepRequest` has every field of a `Request` the runner reads (cast: it is a stand-in).
        out = [SchedulerOutput([ScheduledChunk(cast(Request, StepRequest(m)), m.start, len(m.token_ids),
                                               list(m.block_table), m.right_to_left) for m in mb])
               for mb in self.microbatches]
        out = out or [SchedulerOutput()]  # a copies-only step
        out[0].kv_copies = [list(group) for group in self.kv_copies]
        out[0].landed_copies = self.landed_copies
        return out

    def batch(self) -> SchedulerOutput:
        (batch,) = self.outputs()
        return batch


class _OffsetTokens:
    """Token ids known only from position `start` on: what a worker needs to embed a chunk."""

    def __init__(self, start: int, tokens: Sequence[int]):
        self.start, self.tokens = start, tokens

    def __getitem__(self, positions: slice) -> list[int]:
        return list(self.tokens[positions.start - self.start:positions.stop - self.start])


@dataclass(eq=False)
class StepRequest:
    """A worker's stand-in for a request: the fields `ModelRunner` reads from a chunk's request."""

    message: ChunkMessage
    request_id: str = field(init=False)
    priority: RequestClass = field(init=False)
    token_ids: Any = field(init=False)
    num_tokens: int = field(init=False)
    params: SamplingParams = field(init=False)  # only what the runner reads: prompt_logprobs
    num_prompt_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        m = self.message
        self.request_id, self.priority, self.num_prompt_tokens = m.request_id, m.priority, m.num_prompt_tokens
        self.params = _NO_PARAMS if m.prompt_logprobs is None else SamplingParams(prompt_logprobs=m.prompt_logprobs)
        self.token_ids = _OffsetTokens(m.start, m.token_ids)
        end = m.start + len(m.token_ids)
        self.num_tokens = end if m.samples else end + 1  # what makes `ScheduledChunk.samples` agree


class DriverExecutor(Executor):
    """Rank 0's executor: send the step to the workers, then run this rank's part of it (its
    shard, or as a pipeline, stage 0 of every micro-batch, then sample what the last stage sends
    back)."""

    def __init__(self, runner: ModelRunner, channel: StepChannel, pool: WorkerPool | None,
                 topology: Topology = Topology(), microbatches_per_step: int = 1, depth: int = 1):
        self.runner = runner
        self.channel = channel
        self.pool = pool  # None under torchrun: the workers are not this process's children
        self.topology = topology
        # Token-count chunking's micro-batches per step when the scheduler gives none
        # (`builder.pipeline_microbatches`).
        self.microbatches_per_step = microbatches_per_step
        self.stage = PipelineStage(runner, 0, topology)
        # `MicrobatchPipeline.depth`: micro-batches in flight (1: synchronous steps), as
        # `builder.microbatches_in_flight` decides.
        self.depth = depth
        self.clocked = False  # MicrobatchPipeline: the stages run what was submitted on their own
        self.failed: str | None = None
        self._stopped = False
        atexit.register(self.shutdown)  # an engine never shut down still lets its workers go

    def request_preemption(self) -> None:
        """This rank's runner stops at its next safe point; the ranks agree there (PreemptionFlag)."""
        self.runner.request_preemption()

    def on_safe_point(self, callback: Callable[[], None] | None) -> None:
        self.runner.on_safe_point(callback)  # rank 0's safe points (the ranks agree at each)

    def _check_workers(self) -> None:
        if self.failed is not None:
            raise WorkerFailure(self.failed)
        if self.pool is not None and not self.pool.alive():
            self.failed = "a worker process has died; restart the engine"
            raise WorkerFailure(self.failed)

    def _lost(self, exc: RuntimeError) -> WorkerFailure:  # gloo reports a lost peer as a RuntimeError
        self.failed = f"a parallel step failed, a worker is gone: {exc}"
        return WorkerFailure(self.failed)

    def supports_prompt_logprobs(self) -> bool:
        """Under tensor parallelism every rank runs the runner's step (prompt logprobs included);
        a pipeline's stages compute logits on their own path, which has none."""
        return self.topology.pipeline_parallel_size == 1

    def execute(self, batch: SchedulerOutput) -> ExecutorOutput:
        self._check_workers()
        try:
            if self.topology.pipeline_parallel_size == 1:
                self.channel.post(StepMessage.of(batch))
                return self.runner.execute(batch)
            microbatches = batch.microbatches or split_microbatches(batch.chunks, self.microbatches_per_step)
            self.channel.post(StepMessage.of(batch, microbatches))
            return self.stage.run(self._stage_batches(batch, microbatches))
        except RuntimeError as exc:
            raise self._lost(exc) from exc

    @staticmethod
    def _stage_batches(batch: SchedulerOutput, microbatches: list[list[ScheduledChunk]]) -> list[SchedulerOutput]:
        # Rank 0 runs stage 0 on the real requests (their params and generators sample). A
        # copies-only step (ConServe's prefetch ahead) has no micro-batch: an empty one carries
        # its copies.
        outputs = [SchedulerOutput(mb) for mb in microbatches] or [SchedulerOutput()]
        outputs[0].kv_copies, outputs[0].landed_copies = batch.kv_copies, batch.landed_copies
        return outputs

    # -- MicrobatchPipeline: the engine's asynchronous pipeline -------------------------------
    def submit(self, batch: SchedulerOutput) -> None:
        """Send the step to the workers as one micro-batch and run stage 0 on it."""
        self._check_workers()
        try:
            self.channel.post(StepMessage.of(batch))
            self.stage.submit(self._stage_batches(batch, [batch.chunks] if batch.chunks else []))
        except RuntimeError as exc:
            raise self._lost(exc) from exc

    def collect(self) -> ExecutorOutput:
        self._check_workers()
        try:
            return self.stage.finish()
        except RuntimeError as exc:
            raise self._lost(exc) from exc

    def pipeline_stats(self) -> dict[str, Any]:
        """Busy seconds of each stage (its tensor-parallel rank 0) over the steps so far, rank
        0's span (time with a micro-batch in flight), the bubble ratio, 1 − Σ busy / (stages ·
        span), and the most steps the asynchronous pipeline had in flight at once."""
        if self.stage.in_flight:
            raise RuntimeError("pipeline_stats with micro-batches in flight: step the engine until it is idle")
        self.channel.post(STATS)
        busy: list[Any] = [None] * self.topology.world_size
        dist.gather_object(self.stage.busy_seconds, busy, dst=0, group=self.channel.group)
        per_stage = [busy[ranks[0]] for ranks in map(self.topology.stage_ranks,
                                                      range(self.topology.pipeline_parallel_size))]
        span = self.stage.span_seconds
        ratio = 1.0 - sum(per_stage) / (len(per_stage) * span) if span > 0 else None
        return {"stage_busy_seconds": per_stage, "span_seconds": span, "bubble_ratio": ratio,
                "most_in_flight": self.stage.most_in_flight}

    def shutdown(self) -> None:
        if not self._stopped:
            self._stopped = True
            try:  # take back what is in flight, so no stage is left holding an unreceived send
                while self.stage.in_flight and self.failed is None and (self.pool is None or self.pool.alive()):
                    self.stage.finish()
            except RuntimeError:
                pass
            self.failed = self.failed or "the engine was shut down"
            stop_driver(self.channel, self.pool)


STATS = "stats"  # a control message: every rank reports its pipeline busy time


def worker_loop(runner: ModelRunner, channel: StepChannel, rank: int = 0, topology: Topology = Topology()) -> None:
    """Run every step rank 0 posts until it sends None (shutdown)."""
    stage = PipelineStage(runner, rank, topology)
    while True:
        message = channel.receive()
        if message is None:
            return
        if message == STATS:
            dist.gather_object(stage.busy_seconds, None, dst=0, group=channel.group)
        elif topology.pipeline_parallel_size == 1:
            runner.execute(message.batch())
        else:
            stage.start(message.outputs())
