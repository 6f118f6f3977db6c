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
Python objects, and a gloo broadcast from a dead peer fails instead of hanging.
"""
from __future__ import annotations

import atexit
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch.distributed as dist

from nanoserve.dist.launch import WorkerPool, stop_driver
from nanoserve.memory.host import KVCopy
from nanoserve.model.runner import ExecutorOutput, ModelRunner
from nanoserve.sched.base import ScheduledChunk, SchedulerOutput


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
    priority: str


@dataclass(frozen=True)
class StepMessage:
    chunks: tuple[ChunkMessage, ...]
    kv_copies: tuple[tuple[KVCopy, ...], ...] = ()

    @classmethod
    def of(cls, batch: SchedulerOutput) -> StepMessage:
        return cls(tuple(ChunkMessage(c.request.request_id, tuple(c.request.token_ids[c.start:c.end]), c.start,
                                      tuple(c.block_table), c.right_to_left, c.samples, c.request.priority)
                         for c in batch.chunks),
                   tuple(tuple(group) for group in batch.kv_copies))

    def batch(self) -> SchedulerOutput:
        chunks = [ScheduledChunk(StepRequest(m), m.start, len(m.token_ids), list(m.block_table), m.right_to_left)
                  for m in self.chunks]
        return SchedulerOutput(chunks, kv_copies=[list(group) for group in self.kv_copies])


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
    priority: str = field(init=False)
    token_ids: Any = field(init=False)
    num_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        m = self.message
        self.request_id, self.priority = m.request_id, m.priority
        self.token_ids = _OffsetTokens(m.start, m.token_ids)
        end = m.start + len(m.token_ids)
        self.num_tokens = end if m.samples else end + 1  # what makes `ScheduledChunk.samples` agree


def broadcast_message(message: StepMessage | None, group: Any) -> StepMessage | None:
    holder = [message]
    dist.broadcast_object_list(holder, src=0, group=group)
    return holder[0]


class DriverExecutor:
    """Rank 0's executor: send the step to the workers, then run it on this rank's shard."""

    def __init__(self, runner: ModelRunner, control_group: Any, pool: WorkerPool | None):
        self.runner = runner
        self.control_group = control_group
        self.pool = pool  # None under torchrun: the workers are not this process's children
        self.failed: str | None = None
        self._stopped = False
        atexit.register(self.shutdown)  # an engine never shut down still lets its workers go

    def __getattr__(self, name: str) -> Any:  # model_config, preemption, ... as the runner has them
        return getattr(self.runner, name)

    def execute(self, batch: SchedulerOutput) -> ExecutorOutput:
        if self.failed is not None:
            raise WorkerFailure(self.failed)
        if self.pool is not None and not self.pool.alive():
            self.failed = "a tensor-parallel worker process has died; restart the engine"
            raise WorkerFailure(self.failed)
        try:
            broadcast_message(StepMessage.of(batch), self.control_group)
            return self.runner.execute(batch)
        except RuntimeError as exc:  # gloo reports a lost peer as a RuntimeError
            self.failed = f"tensor-parallel step failed, a worker is gone: {exc}"
            raise WorkerFailure(self.failed) from exc

    def shutdown(self) -> None:
        if not self._stopped:
            self._stopped = True
            self.failed = self.failed or "the engine was shut down"
            stop_driver(self.control_group, self.pool)


def worker_loop(runner: ModelRunner, control_group: Any) -> None:
    """Run every step rank 0 broadcasts until it sends None (shutdown)."""
    while True:
        message = broadcast_message(None, control_group)
        if message is None:
            return
        runner.execute(message.batch())
