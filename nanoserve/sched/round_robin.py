"""Iteration-level round-robin over two FCFS queues (bros.txt §2.2, Observation #2): BROS's
"RR" baseline (§7.1: "we replace the scheduling algorithm of BROS with a Round-Robin schedule
described in Sec. 2.2 and remove the bidirectional KV cache management").

"The system maintains two FCFS queues for RT and BE requests, respectively, and serves them in an
interleaving manner at the iteration level." RT ("online") and BE ("offline") requests take
turns, one class per iteration (Fig. 4): an RT batch, then a BE batch, then an RT batch, ...

    _serve        one class's batch, built as fcfs builds its batch (sched/fcfs.py): the class's
                  running requests oldest first, each taking what it lacks within the token
                  budget (chunked prefill), then its waiting requests in arrival order while
                  budget, blocks and max_num_seqs allow, unless the step had to preempt.
    plan          the class whose turn it is goes; if it has nothing it can run, the other class
                  takes the iteration, so a load of one class runs every iteration (RR
                  "consistently interrupts the processing of RT requests whenever there are BE
                  requests", §7.2.2, and only then). The turn passes to the class that did not run.

Counters (ours, `counters`): the iterations each class served, the requests and tokens in them,
and the turns passed to the other class, to hold the batches against §2.2.

Memory is the paged pool with recompute preemption (no bidirectional blocks). When a request
cannot grow, the newest running request gives way, whatever its class, possibly the request
itself, as in vLLM and fcfs: the oldest running request always advances. A request given a chunk
this step is older than every victim, so it is never preempted in it.
"""
from __future__ import annotations

from collections import deque
from typing import Any

from nanoserve.request import Request, RequestStatus
from nanoserve.sched.base import Scheduler
from nanoserve.sched.output import SchedulerOutput
from nanoserve.slo import RequestClass

CLASSES = (RequestClass.ONLINE, RequestClass.OFFLINE)  # RT, BE
# The keys of `RoundRobinScheduler.counters` (ours).
COUNTERS = ("rt_iterations", "be_iterations", "rt_chunks", "be_chunks", "rt_tokens", "be_tokens", "turn_passed")
_OTHER = {RequestClass.ONLINE: RequestClass.OFFLINE, RequestClass.OFFLINE: RequestClass.ONLINE}


class RoundRobinScheduler(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The two FCFS queues. `self.waiting` (which the engine and the cluster read) keeps every
        # waiting request; these index it by class, so that a class's head is found without
        # walking past the other class's backlog.
        self.queues: dict[RequestClass, deque[Request]] = {cls: deque() for cls in CLASSES}
        self.turn = RequestClass.ONLINE  # the class the next iteration serves
        self.served_class: RequestClass | None = None  # the class the last plan served (tests, stats)
        # Per-class batch composition, to hold against §2.2 (ours; `counters`).
        self._counts = dict.fromkeys(COUNTERS, 0)

    # -- the two queues ------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        super().add_request(request)
        self.queues[request.priority].append(request)

    def preempt(self, request: Request, keep_resident: bool = False) -> bool:
        kept = super().preempt(request, keep_resident)  # to the head of `waiting`: it resumes first, as in fcfs
        self.queues[request.priority].appendleft(request)
        return kept

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        queue = self.queues[request.priority]
        if request.status == RequestStatus.WAITING and request in queue:  # an abort while waiting
            queue.remove(request)
        super().finish_request(request, status)

    def _sync_queues(self) -> None:
        """Rebuild the class queues if `waiting` was changed behind the scheduler's back."""
        if sum(map(len, self.queues.values())) != len(self.waiting):
            self.queues = {cls: deque(r for r in self.waiting if r.priority is cls) for cls in CLASSES}

    # -- the plan ----------------------------------------------------------------------------
    def plan(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._sync_queues()
        self.served_class = None
        turn = self.turn
        for cls in (turn, _OTHER[turn]):
            if self._serve(cls, out):
                self.served_class, self.turn = cls, _OTHER[cls]
                break
        if self.served_class is not None:
            side = "rt" if self.served_class is RequestClass.ONLINE else "be"
            self._counts[f"{side}_iterations"] += 1
            self._counts[f"{side}_chunks"] += len(out.chunks)
            self._counts[f"{side}_tokens"] += sum(c.num_tokens for c in out.chunks)
            self._counts["turn_passed"] += self.served_class is not turn
        return out

    def counters(self) -> dict[str, int]:
        """`COUNTERS`: iterations each class served, the requests (chunks) and tokens they
        carried, and the iterations whose class had nothing to run, so the other took its turn."""
        return dict(self._counts)

    def _serve(self, cls: RequestClass, out: SchedulerOutput) -> bool:
        """Add one class's batch to `out` (fcfs within the class); whether it got any chunk."""
        budget = self.config.max_num_batched_tokens
        scheduled = len(out.chunks)
        for request in [r for r in self.running if r.priority is cls]:  # oldest first
            if budget <= 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:
                continue
            chunk = self.try_chunk(request, num_new)
            while chunk is None:  # make room: the newest running request gives way
                victim = self.running.pop()  # never one served this step: they are all older
                self.preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
                chunk = self.try_chunk(request, num_new)
            if chunk is None:
                break  # the request itself gave way: every newer one already had
            out.chunks.append(chunk)
            budget -= num_new

        # Admitting new work in a step that had to preempt would only thrash (as fcfs).
        queue = self.queues[cls]
        while (not out.preempted and queue and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            request = queue[0]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            chunk = self.try_chunk(request, num_new) if num_new > 0 else None
            if chunk is None:
                break
            queue.popleft()
            self.waiting.remove(request)  # a C-level scan by identity, past the other class at most
            self.admit(request)
            out.chunks.append(chunk)
            budget -= num_new
        return len(out.chunks) > scheduled
