"""FCFS with two classes: online requests before offline ones, and offline work preempted the
moment an online request needs room: "vLLM++ (selective, recompute)", stronger than the vLLM++
ConServe compares against (conserve.txt §3, §6.1: there, running offline requests "cannot be
pre-empted selectively"; that one is sched/priority_nonselective.py).

Each step serves, in this order and under one token budget (chunked prefill as in fcfs):
1. running online requests, oldest first;
2. waiting online requests, in arrival order, preempting running offline requests (newest
   first) to make room, so an online arrival never waits for an offline batch to finish;
3. running offline requests, oldest first;
4. waiting offline requests, unless this step had to preempt (admitting would only thrash).

When a running request cannot grow, the victim is the newest running offline request not yet
served this step, else the newest such online request, else the request itself; a request
that has its chunk for this step is never preempted in it (its forward pass reads its slots).
Offline work gets what online work leaves: there is no SLO model here (that is ConServe's).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from typing import Literal

from nanoserve.request import Request
from nanoserve.sched.base import Scheduler
from nanoserve.sched.output import ScheduledChunk, SchedulerOutput
from nanoserve.slo import RequestClass

CLASSES = (RequestClass.ONLINE, RequestClass.OFFLINE)  # served in this order


def _online_first(requests: Iterable[Request]) -> list[Request]:
    return sorted(requests, key=lambda r: r.priority is not RequestClass.ONLINE)  # stable: FCFS within a class


class PriorityScheduler(Scheduler):
    # The waiting queue is kept online-first. Appending an offline request keeps that order, so
    # the queue (10,000 long under load) is re-sorted only after an online arrival or a preemption.
    _waiting_sorted = True
    # Whether a waiting online request may preempt a running offline one (step 2 above). The
    # non-selective variant (sched/priority_nonselective.py, ConServe's vLLM++) turns it off.
    selective_preemption = True

    def add_request(self, request: Request) -> None:
        super().add_request(request)
        self._waiting_sorted &= request.priority is RequestClass.OFFLINE

    def plan(self) -> SchedulerOutput:
        self._start_step()
        out = SchedulerOutput()
        for cls in CLASSES:
            self._serve_all_running([r for r in self.running if r.priority is cls], out)
            self._after_running(cls, out)
            self._admit_waiting(cls, out)
        return out

    def _start_step(self) -> None:
        """Both queues online-first; a fresh token budget and step bookkeeping."""
        self.running = self.kv.order(_online_first(self.running))
        if not self._waiting_sorted:
            self.waiting = deque(_online_first(self.waiting))
            self._waiting_sorted = True
        self._budget = self.config.max_num_batched_tokens
        self._served: set[str] = set()
        self._preempted: set[str] = set()

    def _serve_all_running(self, requests: list[Request], out: SchedulerOutput) -> None:
        for request in requests:
            if request.request_id not in self._preempted and self._budget > 0:  # a victim is gone
                self._serve_running(request, out)

    # -- what a subclass may change (ConServe: a time budget) --------------------------------
    def _allowance(self, request: Request) -> int:
        """How many tokens `request` may take now: what it lacks, within the token budget."""
        return min(request.num_tokens - request.num_computed_tokens, self._budget)

    def _after_running(self, cls: RequestClass, out: SchedulerOutput) -> None:
        """Called once a class's running requests are served, before its waiting ones are."""

    def _may_make_room(self, request: Request) -> bool:
        """May the waiting `request` preempt others to be admitted? Only an online arrival, and
        only where preemption is selective."""
        return request.priority is RequestClass.ONLINE and self.selective_preemption

    def _give_up(self, request: Request, out: SchedulerOutput) -> None:
        """A running request cannot grow and nobody is left to preempt: it preempts itself."""
        self._evict(request, out)

    def _defer(self, request: Request, out: SchedulerOutput) -> Literal["admit", "defer", "stop"]:
        """Whether to try to admit the waiting `request` now ("admit"), set it aside for this
        step and admit the ones behind it ("defer": ConServe, while its K/V is prefetched), or
        admit nothing more of its class this step ("stop"). Here: always "admit"."""
        return "admit"

    # -- the passes ----------------------------------------------------------------------------
    def _serve_running(self, request: Request, out: SchedulerOutput) -> None:
        num_new = self._allowance(request)
        if num_new <= 0:
            return
        chunk = self.try_chunk(request, num_new)  # the common case: room without preempting
        if chunk is None and self._make_room(request, num_new, out, online_victims=True):
            chunk = self.chunk(request, num_new)
        if chunk is None:  # nobody left to preempt but the request itself
            self._give_up(request, out)
        else:
            self._schedule(request, chunk, out)

    def _admit_waiting(self, cls: RequestClass, out: SchedulerOutput) -> None:
        deferred: list[Request] = []
        while (self.waiting and self.waiting[0].priority is cls and self._budget > 0
               and len(self.running) < self.config.max_num_seqs
               and not (cls is RequestClass.OFFLINE and out.preempted)):
            request = self.waiting[0]
            # A victim of this step sits at the head of the queue: taking it back would thrash.
            if request.request_id in self._preempted:
                break
            decision = self._defer(request, out)
            if decision == "stop":
                break
            if decision == "defer":
                deferred.append(self.waiting.popleft())
                continue
            num_new = self._allowance(request)
            if num_new <= 0:
                break
            # Only an online arrival may preempt, and only offline work.
            chunk = self.try_chunk(request, num_new)
            if (chunk is None and self._may_make_room(request)
                    and self._make_room(request, num_new, out, online_victims=False)):
                chunk = self.chunk(request, num_new)
            if chunk is None:
                break
            self.waiting.remove(request)  # not popleft: preempted victims went to the head
            self.admit(request)
            self._schedule(request, chunk, out)
        self.waiting.extendleft(reversed(deferred))  # back at the head, in their order

    def _make_room(self, request: Request, num_new: int, out: SchedulerOutput, online_victims: bool) -> bool:
        """Preempt until `request` can take `num_new` more tokens: the newest running offline
        request not served this step, else (if allowed) the newest such online one. A request
        with its chunk for this step is never preempted in it. False if no victim is left."""
        while not self.can_chunk(request, num_new):
            victim = self._victim(request, RequestClass.OFFLINE)
            if victim is None and online_victims:
                victim = self._victim(request, RequestClass.ONLINE)
            if victim is None:
                return False
            self._evict(victim, out)
        return True

    def _victim(self, request: Request, cls: RequestClass) -> Request | None:
        """Whom `request` preempts among running `cls` requests: the newest not served this step."""
        return next(self._unserved(request, cls), None)

    def _unserved(self, request: Request, cls: RequestClass) -> Iterator[Request]:
        """Running `cls` requests other than `request` not served this step, newest first."""
        return (r for r in reversed(self.running) if r.priority is cls and r is not request
                and r.request_id not in self._served)

    def _evict(self, request: Request, out: SchedulerOutput, keep_resident: bool = False) -> bool:
        """Preempt a running request (`Scheduler.preempt`); True if its K/V stayed resident."""
        self.running.remove(request)
        resident = self.preempt(request, keep_resident)
        out.preempted.append(request)
        self._preempted.add(request.request_id)
        self._waiting_sorted = False  # it went to the head of the queue
        return resident

    def _schedule(self, request: Request, chunk: ScheduledChunk, out: SchedulerOutput) -> None:
        out.chunks.append(chunk)
        self._served.add(request.request_id)
        self._budget -= chunk.num_tokens
