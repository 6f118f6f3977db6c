"""FCFS with two classes: online requests before offline ones ("vLLM++", the baseline ConServe
compares against in conserve.txt §5, and vLLM's priority scheduling with two levels).

It is `fcfs` with one change of order and one of preemption:

1. Order. Within the running batch and the waiting queue, online requests come first, each class
   in its FCFS order. So online decodes and chunks take the token budget first, waiting online
   requests are admitted first, and when memory runs out the victims (taken from the end of the
   running list, as in fcfs) are offline ones, newest first.
2. Preemption on arrival. If the online request at the head of the queue cannot get KV slots,
   running offline requests are preempted, newest first, until it can (or none are left), before
   the step is planned; so an online arrival never waits for an offline batch to finish.

Offline work gets what online work leaves: there is no SLO model here (that is ConServe's).
"""
from __future__ import annotations

from collections import deque

from nanoserve.request import Request
from nanoserve.sched.base import SchedulerOutput
from nanoserve.sched.fcfs import FCFSScheduler


def _online_first(requests) -> list[Request]:
    return sorted(requests, key=lambda r: r.priority != "online")  # stable: FCFS within a class


class PriorityScheduler(FCFSScheduler):
    def plan(self) -> SchedulerOutput:
        self.running = _online_first(self.running)
        self.waiting = deque(_online_first(self.waiting))
        evicted = self._make_room_for_online()
        out = super().plan()
        out.preempted = evicted + out.preempted
        return out

    def _make_room_for_online(self) -> list[Request]:
        """Preempt offline running requests, newest first, until the first waiting online
        request fits. Runs before planning, so no victim has been given a chunk this step."""
        evicted: list[Request] = []
        if not self.waiting or self.waiting[0].priority != "online":
            return evicted
        head = self.waiting[0]
        first_chunk = min(head.num_tokens - head.num_computed_tokens, self.config.max_num_batched_tokens)
        while not self.can_chunk(head, first_chunk):
            victims = [r for r in self.running if r.priority == "offline"]
            if not victims:
                break
            victim = victims[-1]
            self.running.remove(victim)
            self.preempt(victim)
            evicted.append(victim)
        # Preempted requests went to the head of the queue; the online one stays in front.
        self.waiting = deque(_online_first(self.waiting))
        return evicted
