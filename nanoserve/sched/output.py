"""What a scheduler hands the executor each step (vLLM v1 keeps its `SchedulerOutput` in a module
of its own too): an ordered list of `ScheduledChunk`s, each "advance this request over positions
[start, start + num_tokens)", plus the step's KV copies. The executor (real model, worker ranks,
the simulator) reads only this; it never sees the scheduler.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from nanoserve.memory.copies import KVCopy
from nanoserve.request import Request


class ScheduledChunk(NamedTuple):
    # Immutable like a frozen dataclass, but built several times faster: a step makes one per
    # running request, a thousand or more.
    request: Request
    start: int  # position of the first new token == the request's computed tokens before the step
    num_tokens: int
    block_table: list[int]  # the request's live block table, read-only for the executor
    right_to_left: bool = False  # BROS: this sequence fills each block from its last slot

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """True when this chunk computes the request's last known token, so it yields a new one.
        Under asynchronous scheduling a chunk may end past the known tokens: its last input is a
        token still in flight (`Request.num_pending_tokens`), and it samples too. The answer
        holds from submission to landing: only tokens sampled before the chunk land meanwhile."""
        return self.end >= self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # K/V copies this step issues (checkpoints, swaps, restores): one group per memory-manager
    # call, issued by the executor in this order on its copy stream (memory/copies.py); the
    # forward waits only for those it reads.
    kv_copies: list[list[KVCopy]] = field(default_factory=list)
    # Tickets of earlier copies the KV manager saw land at this step's start: from now on it may
    # reuse what they touched, so every rank's executor retires them first (HostKVStore.retire).
    landed_copies: tuple[int, ...] = ()
    # Under pipeline parallelism, how the policy cuts the chunks into micro-batches (KunServe's
    # lookahead); None lets the executor cut by token count (nanoserve/parallel/pipeline.py).
    microbatches: list[list[ScheduledChunk]] | None = None
    # Wall seconds the scheduler took to plan this step, on this machine's CPU (`Scheduler.schedule`):
    # the simulator may charge it to the step (SimConfig.scheduling_time_scale).
    plan_seconds: float = 0.0

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks and not self.kv_copies
