"""vLLM v0's scheduler (2023), the "vLLM" most of the papers measured against: whole prompts in
iterations of their own, before any decode.

Before chunked prefill (vLLM v0.2-v0.3, the version EcoServe and BROS compare with), each step
was either a prefill step or a decode step:

1. If waiting requests can be admitted, the step admits them in arrival order, each with its
   whole prompt (or, after a preemption, its whole prompt plus what it had generated: it
   recomputes), while their tokens fit `max_num_batched_tokens`, the pool has blocks for them
   and `max_num_seqs` allows. Such a step runs prompts only: the running requests' decodes
   wait for the next step (the "generation stall" chunked prefill removed).
2. Otherwise every running request decodes one token, oldest first; when the pool runs out,
   the newest running request is preempted, by recompute (vLLM's default for one sequence per
   request) back to the front of the waiting queue, or, over the `swap` KV manager (vLLM's swap
   mode, memory/swap.py), into the *swapped* queue.
3. Swapped requests come back in a decode step, oldest first, once no request was preempted in
   it and their K/V fits; while any request is swapped out, no prompt is admitted ("if not
   self.swapped: schedule the waiting prompts", vLLM 0.2's `Scheduler._schedule`). A request
   counts as swapped when its preemption kept K/V off the device (`KVManager.preempt` returned
   tokens); under recompute none does, and this step is skipped.

vLLM v0 required `max_num_batched_tokens >= max_model_len`, so a prompt always fit one step.
nanoserve allows a smaller budget; then a prompt longer than the budget runs alone in budget-
sized pieces, in prefill steps of their own, before anything else.

This is a baseline, kept for the simulator's paper experiments (experiments/): the
difference between it and `fcfs` (vLLM v1) is part of what the papers' gains were measured against.
"""
from __future__ import annotations

from typing import Any

from nanoserve.request import Request, RequestStatus
from nanoserve.sched.base import Scheduler
from nanoserve.sched.output import SchedulerOutput


class PrefillFirstScheduler(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.swapped: list[Request] = []  # preempted with their K/V kept off the device, by arrival

    def plan(self) -> SchedulerOutput:
        out = self._prefill_step() if not self.swapped else SchedulerOutput()
        return out if out.chunks else self._decode_step()

    # -- the swapped queue (vLLM 0.2's `self.swapped`) ----------------------------------------
    def preempt(self, request: Request, keep_resident: bool = False) -> bool:
        kept = super().preempt(request, keep_resident)
        if request.num_computed_tokens > 0:  # kept off the device: swapped, not waiting
            self.waiting.remove(request)
            self.swapped.append(request)
            self.swapped.sort(key=lambda r: r.arrival_time)
        return kept

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        if request in self.swapped:
            self.swapped.remove(request)  # then neither running nor waiting: the base only releases it
        super().finish_request(request, status)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.swapped)

    def has_unfinished_requests(self) -> bool:
        return bool(self.swapped) or super().has_unfinished_requests()

    def _prefill_step(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        for request in self.running:  # a prompt over the budget, part way through
            lacking = request.num_tokens - request.num_computed_tokens
            if lacking > 1:
                chunk = self.try_chunk(request, min(lacking, budget))
                if chunk is not None:  # else the decode step makes room by preemption
                    out.chunks.append(chunk)
                    return out
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            num_new = request.num_tokens - request.num_computed_tokens
            if num_new > budget:
                if out.chunks:
                    break
                num_new = budget
            chunk = self.try_chunk(request, num_new)
            if chunk is None:
                break
            self.waiting.popleft()
            self.admit(request)
            out.chunks.append(chunk)
            budget -= num_new
        return out

    def _decode_step(self) -> SchedulerOutput:
        out = SchedulerOutput()
        i = 0
        while i < len(self.running):
            request = self.running[i]
            chunk = self.try_chunk(request, 1)
            while chunk is None:  # make room by preempting the newest running request
                victim = self.running.pop()
                self.preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
                chunk = self.try_chunk(request, 1)
            if chunk is None:
                break
            out.chunks.append(chunk)
            i += 1
        if not out.preempted:  # vLLM swaps in only in a step that swapped nothing out
            budget = self.config.max_num_batched_tokens - out.num_tokens
            while self.swapped and len(self.running) < self.config.max_num_seqs and budget > 0:
                request = self.swapped[0]
                # Most resume with one token to decode; one swapped mid-prompt finishes it in
                # budget-sized pieces, in the prefill steps that follow.
                chunk = self.try_chunk(request, min(request.num_tokens - request.num_computed_tokens, budget))
                if chunk is None:
                    break
                self.swapped.pop(0)
                self.admit(request)
                out.chunks.append(chunk)
                budget -= chunk.num_tokens
        return out
