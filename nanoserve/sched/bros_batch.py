"""The batch BROS's priority packing builds each step (bros.txt §4.2, Alg. 1): its RT and BE
requests in order, their chunk sizes, the predicted iteration cost (Eq. (2)-(5)) and the time
budget (the smallest residual of its RT requests, Eq. (6)). `nanoserve/sched/bros.py` fills it;
a draft batch (no `out`) only plans and reserves no KV. A batch sees its scheduler only as a
`Packer`: the few attributes and calls it needs, whichever scheduler packs it.
"""
from __future__ import annotations

import math
from functools import cached_property
from typing import TYPE_CHECKING, Protocol

from nanoserve.request import Request, RequestStatus
from nanoserve.sched.output import ScheduledChunk, SchedulerOutput
from nanoserve.slo import RequestClass

if TYPE_CHECKING:
    from collections import deque

    from nanoserve.config import SchedulerConfig
    from nanoserve.sched.cost_model import CostModel

INF = math.inf
RUNNING, WAITING = RequestStatus.RUNNING, RequestStatus.WAITING


def is_rt(request: Request) -> bool:
    return request.priority is RequestClass.ONLINE


class Packer(Protocol):
    """What a `Batch` reads of the scheduler that packs it (`BROSScheduler` is one): its limits and
    cost model, its queues, and for a real batch (with `out`) the calls that admit a waiting
    request and reserve a chunk's KV."""

    config: SchedulerConfig
    cost_model: CostModel
    running: list[Request]
    waiting: deque[Request]

    def admit(self, request: Request) -> None: ...

    def chunk(self, request: Request, num_tokens: int) -> ScheduledChunk: ...


class Batch:
    """A step's batch while it is being packed: chunks, their predicted cost (Eq. (2)-(5), summed
    chunk by chunk: the cost model is linear) and the time budget (the smallest residual, Eq. (6)).
    Plain attributes, read and updated in place: BROS's loops touch them for every candidate."""

    def __init__(self, scheduler: Packer, now: float, out: SchedulerOutput | None = None,
                 draft: Batch | None = None) -> None:
        self.scheduler, self.now, self.model = scheduler, now, scheduler.cost_model
        self.out = out  # None: a draft, which reserves nothing
        self.draft = draft
        self.gone: set[int] = set()  # evicted this step
        self.replaced: set[int] = set()  # RT requests a BE request replaced (in a draft)
        self.held: set[int] = set()  # the requests given a chunk
        self.rt: list[Request] = []  # urgency order
        self.rt_chunks: list[tuple[int, float, float]] = []  # (tokens, cost, residual), as `rt`
        self.be: list[Request] = []
        self.be_chunks: list[tuple[int, float]] = []  # (tokens, cost), as `be`
        self.chunk_cost = 0.0
        self.budget = INF  # the smallest residual, kept as RT requests come and go
        self.budget_holders = 0  # RT requests whose residual is the budget (residuals often tie)
        self.tokens_left = scheduler.config.max_num_batched_tokens
        self.free_seats = scheduler.config.max_num_seqs - len(scheduler.running)
        self.admitted = 0  # waiting requests in the batch
        self.risk = False  # SLO risk: reset the batch size
        self.stop = False  # lines 11-12's early return: no BE work this step
        # Constraint (7) met a candidate: a request was in hand while the batch held `batch_size`
        # requests (then a BE request may replace an RT one, or the packing ends). Counted (ours).
        self.size_bound = False
        # What the real pass needs to know to replay a draft (see BROSScheduler._replay_rt).
        self.rt_stop = False  # the RT packing's outcome
        self.seatless = False  # an RT request was passed over for lack of a seat
        self.waiting_closed = False  # no block can take an RT page: waiting RT requests are not tried
        self.constrained = False  # the last BE decision gave less than a whole chunk
        self.unsettled = False  # ... and a BE decision after it followed
        self.host_version = 0  # the host-slot counts BE requests were ordered by
        # Eviction orders for this step (BROSScheduler._rt_victim): BE victims, RT victims.
        self.victims: tuple[list[Request], list[tuple[Request, tuple]]] | None = None
        self.be_cursor = 0
        self.youngest_rt: tuple | None = None  # the latest seniority among RT victims

    def __len__(self) -> int:
        return len(self.held)

    def holds(self, request: Request) -> bool:
        return id(request) in self.held

    def evicted(self, request: Request) -> bool:
        return id(request) in self.gone

    @property
    def cost(self) -> float:
        return self.chunk_cost + self.model.iteration if self.held else 0.0

    def largest_chunk_within_budget(self, request: Request) -> tuple[int, float]:
        """The longest chunk (up to what it lacks and the token budget) that keeps the batch
        within the time budget, and its cost; (0, 0.0) if none does. Cost grows with the chunk,
        so bisect."""
        computed, chunk_cost = request.num_computed_tokens, self.model.chunk_cost
        hi = min(request.num_tokens - computed, self.tokens_left)
        if hi <= 0:
            return 0, 0.0
        cost = chunk_cost(computed, hi)
        if self.chunk_cost + cost + self.model.iteration <= self.budget:
            return hi, cost
        lo = 0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.chunk_cost + chunk_cost(computed, mid) + self.model.iteration <= self.budget:
                lo = mid
            else:
                hi = mid - 1
        return lo, chunk_cost(computed, lo) if lo else 0.0

    @cached_property
    def evictable(self) -> int:
        """Running BE requests: an RT request may evict one for a seat (counted only if asked)."""
        return sum(r.priority is not RequestClass.ONLINE for r in self.scheduler.running)

    def has_seat(self, request: Request) -> bool:
        """Room under max_num_seqs: a waiting RT request may evict a running BE one for it."""
        if request.status is RUNNING or self.admitted < self.free_seats:
            return True
        return is_rt(request) and self.admitted < self.free_seats + self.evictable

    def add(self, request: Request, num_new: int, cost: float, residual: float | None = None,
            at: int | None = None, chunk: ScheduledChunk | None = None) -> None:
        """Put `request` in with a chunk of `num_new` tokens costing `cost`; an RT request brings
        its residual. For real, this admits it and reserves its chunk's KV (unless `chunk`, the
        caller's `try_chunk`, already did)."""
        waiting = request.status is WAITING
        if self.out is not None:
            if waiting:
                self.scheduler.waiting.remove(request)
                self.scheduler.admit(request)
            self.out.chunks.append(chunk if chunk is not None else self.scheduler.chunk(request, num_new))
        self.held.add(id(request))
        self.chunk_cost += cost
        self.tokens_left -= num_new
        if waiting:
            self.admitted += 1
        if residual is None:
            self.be.append(request)
            self.be_chunks.append((num_new, cost))
            return
        at = len(self.rt) if at is None else at
        self.rt.insert(at, request)
        self.rt_chunks.insert(at, (num_new, cost, residual))
        if residual < self.budget:
            self.budget, self.budget_holders = residual, 1
        elif residual == self.budget:
            self.budget_holders += 1

    def remove(self, at: int) -> tuple[Request, int, float, float, int]:
        """Take the RT request at `at` out of a draft; returns what `restore` needs to put it back."""
        assert self.out is None, "a chunk already reserved is never taken back"
        request = self.rt.pop(at)
        num_new, cost, residual = self.rt_chunks.pop(at)
        self.held.discard(id(request))
        self.chunk_cost -= cost
        self.tokens_left += num_new
        if request.status is not RUNNING:
            self.admitted -= 1
        self.replaced.add(id(request))
        if residual == self.budget:
            self.budget_holders -= 1
            if not self.budget_holders:  # it was the last with the smallest: find the next
                residuals = [chunk[2] for chunk in self.rt_chunks]
                self.budget = min(residuals, default=INF)
                self.budget_holders = residuals.count(self.budget)
        return request, num_new, cost, residual, at

    def restore(self, removed: tuple[Request, int, float, float, int]) -> None:
        request, num_new, cost, residual, at = removed
        self.replaced.discard(id(request))
        self.add(request, num_new, cost, residual, at)
