"""What every scheduling policy shares: the queues, the batch it hands the executor, and the
bookkeeping after a step.

A policy decides, each step, which requests advance and by how many tokens, within one token
budget (`max_num_batched_tokens`) and one sequence cap (`max_num_seqs`). It sees requests and
memory managers, never the model. Its decision is a `SchedulerOutput`: an ordered list of
`ScheduledChunk`s, each "advance this request over positions [start, start + num_tokens)".
The executor (real model or simulator) runs the chunks; a chunk that brings its request level
with all its tokens also samples the request's next token.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field

from nanoserve.config import SchedulerConfig
from nanoserve.memory.blocks import BlockPool
from nanoserve.memory.host import KVCopy
from nanoserve.request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledChunk:
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
        """True when this chunk computes the request's last known token, so it yields a new one."""
        return self.end == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # KV moves between device and host that must happen before this step's forward pass
    # (checkpoints, restores, swaps), decided by the memory manager and run by the executor.
    copies: list[KVCopy] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks and not self.copies


class Scheduler(ABC):
    def __init__(self, config: SchedulerConfig, pool: BlockPool):
        self.config = config
        self.pool = pool
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # -- what a policy implements --------------------------------------------------------
    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Pick this step's chunks, allocating their KV slots (and preempting if it must)."""

    # -- shared bookkeeping --------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def update_after_step(self, output: SchedulerOutput) -> None:
        """The executor has written K/V for every scheduled token."""
        for chunk in output.chunks:
            chunk.request.num_computed_tokens = chunk.end

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Take a request out of the queues for good and release its KV."""
        assert status.finished
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        self.pool.free(request.request_id)

    def preempt(self, request: Request) -> None:
        """Preempt by recompute: drop the KV, keep the tokens, wait at the head of the queue."""
        self.pool.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def admit(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def chunk(self, request: Request, num_tokens: int) -> ScheduledChunk:
        """Reserve KV slots for `num_tokens` more tokens of `request` and describe the chunk."""
        start = request.num_computed_tokens
        self.pool.allocate(request.request_id, start + num_tokens)
        return ScheduledChunk(request, start, num_tokens, self.pool.block_table(request.request_id))

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)
