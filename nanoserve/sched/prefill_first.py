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
   the newest running request is preempted by recompute (vLLM's default for one sequence per
   request), back to the front of the waiting queue.

vLLM v0 required `max_num_batched_tokens >= max_model_len`, so a prompt always fit one step.
nanoserve allows a smaller budget; then a prompt longer than the budget runs alone in budget-
sized pieces, in prefill steps of their own, before anything else.

This is a baseline, kept for the simulator's paper experiments (sim/experiments/): the
difference between it and `fcfs` (vLLM v1) is part of what the papers' gains were measured against.
"""
from __future__ import annotations

from nanoserve.sched.base import Scheduler, SchedulerOutput


class PrefillFirstScheduler(Scheduler):
    def plan(self) -> SchedulerOutput:
        out = self._prefill_step()
        return out if out.chunks else self._decode_step()

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
        return out
