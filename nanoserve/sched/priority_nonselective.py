"""vLLM++ as ConServe defines it (conserve.txt §3, §6.1): vLLM with a priority queue, online
requests before offline ones, chunked prefill, and no selective preemption.

ConServe's baseline is "a priority scheduler atop vLLM" (vLLM 0.4.2) with "chunked-prefill"
enabled and a batch API for offline requests (§6.1). What makes it weak for co-serving is stated
in §3: "once offline requests are scheduled, they are batched together with online requests and
cannot be pre-empted selectively. Therefore, incoming online requests must wait until they are
served". So each step, as vLLM 0.4.2's chunked-prefill scheduler orders it:

1. running requests, online first, then offline, oldest first within a class, each take what
   they lack within the token budget. When one cannot grow, the newest running offline request
   not served this step is preempted, else the newest such online one, else the request itself
   (vLLM pops the lowest-priority, newest request off its sorted running queue);
2. waiting requests, online first, then offline, are admitted while budget, memory and
   `max_num_seqs` allow. A waiting online request never preempts a running offline one: it waits
   for memory like anyone else. Preempted requests sit at the head of their class.

Only memory pressure preempts, and with the `swap` KV manager (memory/swap.py) it swaps, as
ConServe describes vLLM doing (§4.4, Fig. 4b): the configuration the simulator's baselines table
calls "vLLM++ (ConServe)". Assumption: swap. vLLM 0.4.2 itself recomputed a single-sequence
request by default; over the `paged` manager this policy does that, and the experiments run
both. Today's `priority` policy (sched/priority.py), which does preempt offline work the moment
an online request needs room, is the stronger "vLLM++ (selective, recompute)".
"""
from __future__ import annotations

from nanoserve.sched.output import SchedulerOutput
from nanoserve.sched.priority import CLASSES, PriorityScheduler


class NonSelectivePriorityScheduler(PriorityScheduler):
    selective_preemption = False

    def plan(self) -> SchedulerOutput:
        self._start_step()
        out = SchedulerOutput()
        self._serve_all_running(list(self.running), out)  # every running request before any waiting one
        for cls in CLASSES:
            self._admit_waiting(cls, out)
        return out
