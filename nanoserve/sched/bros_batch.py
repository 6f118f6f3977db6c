"""The batch BROS's priority packing builds each step (bros.txt §4.2, Alg. 1): its RT and BE
requests in order, their chunk sizes, the predicted iteration cost (Eq. (2)-(5)) and the time
budget (the smallest residual of its RT requests, Eq. (6)). `nanoserve/sched/bros.py` fills it;
a draft batch (no `out`) only plans and reserves no KV.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from nanoserve.request import Request, RequestStatus
from nanoserve.sched.base import SchedulerOutput

if TYPE_CHECKING:
    from nanoserve.sched.bros import BROSScheduler

INF = math.inf


def is_rt(request: Request) -> bool:
    return request.priority == "online"


class Batch:
    """A step's batch while it is being packed: chunks, their predicted cost (Eq. (2)-(5), summed
    chunk by chunk: the cost model is linear) and the time budget (the smallest residual, Eq. (6))."""

    def __init__(self, scheduler: BROSScheduler, now: float, out: SchedulerOutput | None = None,
                 draft: Batch | None = None):
        self.scheduler, self.now, self.model = scheduler, now, scheduler.cost_model
        self.out = out  # None: a draft, which reserves nothing
        self.draft = draft
        self.gone: set[int] = set()  # evicted this step
        self.replaced: set[int] = set()  # RT requests a BE request replaced (in a draft)
        self.rt: list[Request] = []  # urgency order
        self.be: list[Request] = []
        self.sizes: dict[int, int] = {}
        self.residuals: dict[int, float] = {}
        self.chunk_cost = 0.0
        self.tokens_left = scheduler.config.max_num_batched_tokens
        self.free_seats = scheduler.config.max_num_seqs - len(scheduler.running)
        self.evictable = sum(not is_rt(r) for r in scheduler.running)  # RT may evict BE for a seat
        self.admitted = 0  # waiting requests in the batch
        self.risk = False  # SLO risk: reset the batch size
        self.stop = False  # lines 11-12's early return: no BE work this step

    def __len__(self) -> int:
        return len(self.rt) + len(self.be)

    def holds(self, request: Request) -> bool:
        return id(request) in self.sizes

    def evicted(self, request: Request) -> bool:
        return id(request) in self.gone

    @property
    def cost(self) -> float:
        return self.chunk_cost + self.model.iteration if self.sizes else 0.0

    @property
    def budget(self) -> float:
        return min(self.residuals.values(), default=INF)

    def chunk_size(self, request: Request) -> int:
        return max(0, min(request.num_tokens - request.num_computed_tokens, self.tokens_left))

    def cost_with(self, request: Request, num_new: int) -> float:
        return self.chunk_cost + self.model.chunk_cost(request.num_computed_tokens, num_new) + self.model.iteration

    def largest_chunk_within_budget(self, request: Request) -> int:
        """The longest chunk (up to what it lacks and the token budget) that keeps the batch
        within the time budget; 0 if none does. Cost grows with the chunk, so bisect."""
        hi, budget = self.chunk_size(request), self.budget
        if hi == 0 or self.cost_with(request, hi) <= budget:
            return hi
        lo = 0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.cost_with(request, mid) <= budget:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def has_seat(self, request: Request) -> bool:
        """Room under max_num_seqs: a waiting RT request may evict a running BE one for it."""
        if request.status == RequestStatus.RUNNING:
            return True
        return self.admitted < self.free_seats + (self.evictable if is_rt(request) else 0)

    def add(self, request: Request, num_new: int, residual: float | None = None, at: int | None = None) -> None:
        waiting = request.status == RequestStatus.WAITING
        if self.out is not None:  # for real: admit it and reserve its chunk's KV now
            if waiting:
                self.scheduler.waiting.remove(request)
                self.scheduler.admit(request)
            self.out.chunks.append(self.scheduler.chunk(request, num_new))
        self.sizes[id(request)] = num_new
        self.chunk_cost += self.model.chunk_cost(request.num_computed_tokens, num_new)
        self.tokens_left -= num_new
        self.admitted += waiting
        if residual is None:
            self.be.append(request)
        else:
            self.rt.insert(len(self.rt) if at is None else at, request)
            self.residuals[id(request)] = residual

    def remove(self, request: Request) -> tuple[Request, int, float, int]:
        """Take an RT request out of a draft; returns what `restore` needs to put it back."""
        assert self.out is None, "a chunk already reserved is never taken back"
        at, num_new, residual = self.rt.index(request), self.sizes.pop(id(request)), self.residuals.pop(id(request))
        self.rt.remove(request)
        self.chunk_cost -= self.model.chunk_cost(request.num_computed_tokens, num_new)
        self.tokens_left += num_new
        self.admitted -= request.status != RequestStatus.RUNNING
        self.replaced.add(id(request))
        return request, num_new, residual, at

    def restore(self, removed: tuple[Request, int, float, int]) -> None:
        request, num_new, residual, at = removed
        self.replaced.discard(id(request))
        self.add(request, num_new, residual, at)
