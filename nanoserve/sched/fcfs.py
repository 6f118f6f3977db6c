"""The baseline policy: vLLM v1's first-come-first-served scheduler with chunked prefill.

There is no "prefill phase" and "decode phase". Every request simply has tokens whose K/V are
not yet computed (a whole prompt, the rest of a chunked prompt, one new token, or everything
again after a preemption), and each step lets requests catch up under one token budget:

1. Running requests, oldest first, each take as many tokens as they lack (a decode takes 1, a
   prompt chunk takes what is left of the budget). If the pool has no blocks for them, the
   newest running request is preempted by recompute, repeatedly, possibly the request itself.
2. If nothing was preempted, waiting requests are admitted in arrival order while budget,
   blocks and `max_num_seqs` allow. The last one admitted may get only a chunk of its prompt.

Decode tokens and prefill chunks therefore share one batch (Sarathi-Serve's stall-free
batching, Agrawal et al., OSDI'24), and a long prompt never blocks running decodes for more
than its chunk.

Under an asynchronous pipeline (`SchedulerConfig.microbatches_in_flight` > 1) each step is one
micro-batch of the pipeline: requests whose sampled token is still in flight are skipped, and a
step advances at most its share of the running requests (`Scheduler.running_share`). Under
asynchronous scheduling (`SchedulerConfig.async_scheduling`) a running request's token in flight
does not hold it back (`Scheduler.schedulable`): the executor feeds it from the device.

With prefix caching, a waiting request's chunk starts after its cached prefix
(`Scheduler.tokens_lacking`), so admitting it costs only its uncached tokens of the budget. A
waiting request whose next block another request is computing in this very step waits one step
(`KVManager.prefix_in_flight`; ours): admitted now it would compute that block again, a step
later it finds it cached. (vLLM v1 caches blocks when it allocates them, so a request admitted
in the same step shares them at once; here a block is shared only once a step has written it,
which keeps a discarded step, ConServe's, from leaving unwritten blocks cached.) The
option `waiting_order="lpm"` (SGLang's longest-prefix-match policy; ours here, off by default)
admits, among the first `LPM_WINDOW` waiting requests, those with the longest cached prefix
first, so that requests sharing what is cached now run while it is still cached. Beyond the
window, and on ties, arrival order: SGLang turns LPM off for a long queue altogether
(`_determine_active_policy`), as sorting it every step would cost more than it saves. A request
with nothing cached can wait behind later ones while they keep hitting; the window bounds how
many.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from nanoserve.config import SchedulerConfig
from nanoserve.memory.blocks import BlockPool
from nanoserve.memory.manager import KVManager
from nanoserve.request import Request
from nanoserve.sched.base import Scheduler
from nanoserve.sched.cost_model import CostModel
from nanoserve.sched.output import SchedulerOutput

LPM_WINDOW = 128  # waiting requests `waiting_order="lpm"` reorders; assumption: a round number, not swept
WAITING_ORDERS = ("fcfs", "lpm")


class FCFSScheduler(Scheduler):
    ASYNC_PIPELINE = True
    ASYNC_SCHEDULING = True
    OPTIONS = {"waiting_order": "fcfs (default): arrival order; lpm: longest cached prefix first among the first "
                                f"{LPM_WINDOW} waiting requests (SGLang's)"}

    def __init__(self, config: SchedulerConfig, kv: KVManager | BlockPool, cost_model: CostModel | None = None,
                 clock: Callable[[], float] = time.monotonic):
        super().__init__(config, kv, cost_model, clock)
        self.waiting_order: str = config.policy_options.get("waiting_order", "fcfs")
        if self.waiting_order not in WAITING_ORDERS:
            raise ValueError(f"waiting_order must be one of {', '.join(WAITING_ORDERS)}, got {self.waiting_order!r}")

    def order_waiting(self) -> None:
        """`waiting_order="lpm"`: the first `LPM_WINDOW` waiting requests, longest cached prefix
        first (stable: arrival order on ties)."""
        if self.waiting_order != "lpm" or len(self.waiting) < 2:
            return
        head = [self.waiting.popleft() for _ in range(min(LPM_WINDOW, len(self.waiting)))]
        head.sort(key=lambda r: -self.cached_prefix(r))
        self.waiting.extendleft(reversed(head))

    def tokens_wanted(self, request: Request) -> int:
        """How many tokens `request` would advance by with no budget limit: all it lacks.
        A subclass may offer less (KunServe: its share of this step's micro-batch); 0 stops
        the pass, as a request outside the step has nothing after it inside it either."""
        return self.tokens_lacking(request)

    def step_token_budget(self) -> int:
        """Tokens this step may schedule: the config's budget. A subclass may look further
        (KunServe's pipelined lookahead keeps several micro-batches' worth in flight)."""
        return self.config.max_num_batched_tokens

    def plan(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.step_token_budget()
        self.running = self.kv.order(self.running)

        i, share = 0, self.running_share()
        while i < len(self.running) and budget > 0 and share > 0:
            request = self.running[i]
            if not self.schedulable(request):  # its next token is still in flight
                i += 1
                continue
            num_new = min(self.tokens_wanted(request), budget)
            if num_new == 0:
                break
            chunk = self.try_chunk(request, num_new)
            while chunk is None:  # make room by preempting the newest running request
                victim = self.running.pop()
                self.preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
                chunk = self.try_chunk(request, num_new)
            if chunk is None:
                break  # the request itself was preempted: nothing after it remains
            out.chunks.append(chunk)
            budget -= num_new
            share -= 1
            i += 1

        # Admitting new work in a step that had to preempt would only thrash.
        if not out.preempted:
            self.order_waiting()
        while (not out.preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[0]
            if request.num_pending_tokens:  # preempted with a token in flight
                break
            if self.kv.prefix_in_flight(request):  # its next block is being computed: cached next step
                break
            num_new = min(self.tokens_wanted(request), budget)
            chunk = self.try_chunk(request, num_new) if num_new else None
            if chunk is None:
                break
            self.waiting.popleft()
            self.admit(request)
            out.chunks.append(chunk)
            budget -= num_new
        return out
