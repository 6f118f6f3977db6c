"""EcoServe's scheduling (ecoserve.txt §3): SyncDecoupled batching with Ordering, over exact
allocation (`memory/exact_kv.py`, the policy's default KV manager).

The paper splits each request into its prompt tasks (PTs) and its generation tasks (GTs), and
gives each resource to one of them (§3.2.1): GTs fill the KV cache, PTs fill the GPU, i.e. the
step's target forward size (TFS). One step of Algorithm 1 (§3.5) maps onto `plan` as follows:

    Alg. 1 / paper                           here
    ---------------------------------------  ----------------------------------------------------
    the running batch's GTs (time-synced     `_split_tasks`: every admitted request that is
    groups, §3.2.2) advance one token each   decoding (lacks one token) gets one token
    line 5: PTs from Q_P until Σ L_p = TFS   `_fill_prompts`: admitted requests still prefilling
    (§3.2.1), TFS from the cost model        (or recomputing) share `target_forward_size` minus
                                             the decodes, ordered (§3.3), bisect for the longest
                                             whole prompt that fits, else a chunk
    line 1-2: when a GT group completes,     `_admit_groups`: the generation queue Q_G is the
    GT groups from Q_G until Σ L_r = A_KVC   waiting queue (new and preempted requests, indexed
                                             in `_queue`, sched/ecoserve_queue.py), grouped
                                             by equal predicted RL (`predicted_rl`: the manager's
                                             `prediction` if it has one, L_new after a
                                             preemption, else max_tokens); ordered (§3.3), bisect
                                             for the group whose RL is closest below the free KV;
                                             a group that does not fit whole is split
    line 3: hosted GTs (KVCPipeline, §3.4)   the manager places an admitted request in a host's
                                             unused allocation when one fits (exact_kv), so a
                                             request longer than the free KV is still tried
    lines 7-9: Ordering of new/preempted     `_gt_key`: kept by `_queue`, which keys a request
    GTs (§3.3)                               once as it joins Q_G (only its deadline bucket moves
                                             while it waits, and `advance` moves just those), so
                                             a step touches only what it admits or moves;
                                             `_pt_key`: the few prefilling requests, re-sorted
                                             every step
    under-prediction (§3.2.2)                padding and the reserved pool are the manager's; a
                                             running request it says cannot grow is preempted
                                             offload-free (`self.preempt`), gets L_new as its
                                             prediction, and is re-admitted with its group later

Ordering (§3.3), for both queues: ascending deadline bucket (the SLO deadline of the request's
next token: arrival + TTFT before the first token, then first token + TPOT per later token;
slack < 0.5 s, < 2 s, later, no target), then descending occupied-KV bucket (tokens whose KV
the request holds, or held before a preemption, in `kv_bucket_tokens` ranges), then descending
length (predicted RL for GTs, remaining prompt for PTs), then arrival; ties on all of it keep
the waiting deque's order (preempted requests at its front). Within one (deadline, occupied)
bucket the tasks are thus sorted by length, and `bisect` finds the one closest below the room left.

Adaptations to this framework, where a request's KV lives from admission to finish:
- exact_kv reserves prompt + padded RL at admission, so a GT group's admission and its PT's
  first chunk coincide (an admitted request gets a chunk at once); Σ L_r is checked by the
  manager (`can_chunk`), the bisect over RL only picks where to start.
- All admitted GTs decode every step (their KV is held anyway; time-synced groups end together
  because they were admitted together with equal RL). Decodes are never cut by the TFS.
- The TFS is the largest token count whose predicted iteration time (cost model, one prefill
  chunk at prefix 0 next to the decodes) stays under `tfs_target` (default: the online TPOT
  target, since every iteration is one decode step of every running GT), capped by the token
  budget; prompts always get at least `min_prefill_tokens` so they advance under any target.
- Running requests are served in `self.kv.order(running)` (hosts before guests, exact_kv §3.4),
  whatever their queue, so a host's growth never evicts a guest already given a chunk.
- No admissions in a step that preempted (as fcfs): the freed KV goes to the running batch.
"""
from __future__ import annotations

import math
import time
from bisect import bisect_left, bisect_right
from itertools import groupby
from typing import Callable

from nanoserve.config import SchedulerConfig
from nanoserve.memory.blocks import BlockPool
from nanoserve.memory.manager import KVManager
from nanoserve.request import Request, RequestStatus
from nanoserve.sched.base import Scheduler, SchedulerOutput
from nanoserve.sched.cost_model import CostModel
from nanoserve.sched.ecoserve_queue import GenerationQueue, deadline_bucket


def _lacking(request: Request) -> int:
    return request.num_tokens - request.num_computed_tokens


class EcoServeScheduler(Scheduler):
    deadline_buckets: tuple[float, ...] = (0.5, 2.0)  # §3.3's slack ranges, seconds
    kv_bucket_tokens: int = 128  # §3.3's magnitude ranges for occupied KV
    min_prefill_tokens: int = 16  # prompts advance even when decodes alone exceed the TFS target
    max_failed_admissions: int = 32  # can_chunk refusals per step before admission gives up

    def __init__(self, config: SchedulerConfig, kv: KVManager | BlockPool, cost_model: CostModel | None = None,
                 clock: Callable[[], float] = time.monotonic, tfs_target: float | None | str = "online_tpot"):
        super().__init__(config, kv, cost_model, clock)
        # Seconds one iteration may take: by default the online TPOT target (None: no time cap).
        self.tfs_target = config.online_slo.tpot if tfs_target == "online_tpot" else tfs_target
        # Q_G: `self.waiting` indexed by `_gt_key`. Requests that joined `self.waiting` since the
        # last admission pass wait in `_unqueued` (True: at the deque's front), in deque order, and
        # are keyed at the next one: that is when a full re-sort would have asked the predictor.
        self._queue = GenerationQueue(self.deadline_buckets)
        self._unqueued: dict[Request, bool] = {}

    # -- the waiting queue: `self.waiting` for the engine and base class, `_queue` for the order
    def add_request(self, request: Request) -> None:
        super().add_request(request)
        self._unqueued[request] = False

    def preempt(self, request: Request) -> None:
        super().preempt(request)
        self._unqueued[request] = True

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        if request in self._unqueued:
            del self._unqueued[request]
        elif request in self._queue:
            self._queue.remove(request)
        super().finish_request(request, status)

    def _queue_arrivals(self) -> None:
        for request, at_front in self._unqueued.items():
            self._queue.add(request, deadline=self.next_token_deadline(request),
                            occupied_bucket=self._occupied_bucket(request),
                            predicted_rl=self.predicted_rl(request), at_front=at_front)
        self._unqueued.clear()

    # -- the step (Algorithm 1) ------------------------------------------------------------
    def plan(self) -> SchedulerOutput:
        out = SchedulerOutput()
        running = self.running = self.kv.order(self.running)
        now = self.clock()
        budget = self.config.max_num_batched_tokens

        decodes, decode_batch, prompts = self._split_tasks(budget)
        budget -= len(decodes)
        tfs = self.target_forward_size(decode_batch)
        prompt_budget = min(budget, max(tfs - len(decodes), self.min_prefill_tokens))
        allotted = dict.fromkeys(decodes, 1)
        for request, num_new in self._fill_prompts(prompts, prompt_budget, now):
            allotted[request] = num_new
            prompt_budget -= num_new

        # Serve in the manager's order; preempt whoever it says cannot grow (§3.2.2).
        for request in list(running):
            num_new = allotted.get(request)
            if num_new is None:
                continue
            # A dropped guest lacks more, never less. (`_lacking` inline: 1,000 times a step.)
            num_new = min(num_new, len(request.token_ids) - request.num_computed_tokens)
            if self.can_chunk(request, num_new):
                out.chunks.append(self.chunk(request, num_new))
            else:
                self.running.remove(request)
                self.preempt(request)
                out.preempted.append(request)

        if not out.preempted:
            self._admit_groups(out, prompt_budget, now)
        return out

    def _split_tasks(self, budget: int) -> tuple[list[Request], list[tuple[int, int]], list[Request]]:
        """The running GTs (one token lacking; the first `budget` of them), the same as the cost
        model's (prefix, 1) chunks, and the PTs (more lacking), in the manager's order: one pass,
        as it reads every running request."""
        decodes: list[Request] = []
        decode_batch: list[tuple[int, int]] = []
        prompts: list[Request] = []
        for request in self.running:
            # len(token_ids) is `num_tokens` without a property call: this runs 1,000s of times a step.
            lacking = len(request.token_ids) - request.num_computed_tokens
            if lacking == 1:
                decodes.append(request)
                decode_batch.append((request.num_computed_tokens, 1))
            elif lacking > 1:
                prompts.append(request)
        budget = max(budget, 0)
        return decodes[:budget], decode_batch[:budget], prompts

    def target_forward_size(self, decodes: list[tuple[int, int]]) -> int:
        """The TFS: decodes plus the largest prefill chunk whose predicted iteration time stays
        under `tfs_target`, within the token budget (§3.2.1: PTs fill the GPU)."""
        cap = self.config.max_num_batched_tokens
        room = cap - len(decodes)
        if self.tfs_target is None or room <= 0:
            return cap
        model = self.cost_model
        # A batch costs the sum of its chunks' costs plus one iteration constant (Eq. 3), so the
        # decodes are priced once, not once per bisect probe: 1,000 decodes, 13 probes.
        with_decodes = model.predict(decodes) if decodes else 0.0

        def cost(chunk: int) -> float:
            if not decodes:
                return model.predict([(0, chunk)] if chunk else [])
            return with_decodes + (model.chunk_cost(0, chunk) if chunk else 0.0)

        # cost() never decreases with the chunk (coefficients are >= 0): bisect over sizes.
        largest = bisect_right(range(room + 1), self.tfs_target, key=cost) - 1
        return len(decodes) + max(largest, 0)

    def _fill_prompts(self, prompts: list[Request], budget: int, now: float) -> list[tuple[Request, int]]:
        """§3.2.1 line 5: PTs in §3.3 order until the budget (TFS) is spent; in each bucket the
        longest prompt that fits whole (bisect), else a chunk of the one closest above."""
        picks: list[tuple[Request, int]] = []
        for bucket in self._buckets(prompts, self._pt_key, now):
            while bucket and budget > 0:
                i = bisect_left(bucket, -budget, key=lambda r: -_lacking(r))
                request = bucket.pop(min(i, len(bucket) - 1))
                num_new = min(_lacking(request), budget)
                picks.append((request, num_new))
                budget -= num_new
        return picks

    def _admit_groups(self, out: SchedulerOutput, budget: int, now: float) -> None:
        """Alg. 1 lines 2-3: equal-RL GT groups from the waiting queue, in §3.3 order, until the
        KV is full; each admitted request starts its prompt with what is left of the TFS."""
        self._queue.advance(now)  # first: arrivals are placed by their slack at `now`
        self._queue_arrivals()
        failures, free_kv = 0, self._free_kv_tokens()
        for group in self._queue.groups():
            refused: set[Request] = set()  # by can_chunk this step: passed over, as if popped
            while budget > 0 and len(self.running) < self.config.max_num_seqs:
                # The group whose RL is closest below the free KV; if none, the shortest (it may
                # still be hosted in a running request's unused allocation, §3.4).
                request = self._queue.closest_below(group, free_kv, refused)
                if request is None:
                    break
                if failures >= self.max_failed_admissions:
                    return
                num_new = min(_lacking(request), budget)
                if not self.can_chunk(request, num_new):
                    failures += 1
                    refused.add(request)
                    continue
                self._queue.remove(request)
                self.waiting.remove(request)
                self.admit(request)
                out.chunks.append(self.chunk(request, num_new))
                budget -= num_new
                free_kv = self._free_kv_tokens()

    # -- Ordering (§3.3) -------------------------------------------------------------------
    def predicted_rl(self, request: Request) -> int:
        """The request's predicted remaining response length: the KV manager's (exact_kv: the
        predictor's, or L_new after a preemption), else what max_tokens allows. Fixed while the
        request waits: the queue asks once, when the request joins it."""
        prediction = getattr(self.kv, "prediction", None)
        if callable(prediction):
            return prediction(request)
        return request.output_tokens_left

    def next_token_deadline(self, request: Request) -> float:
        """When the request's next token is due under its SLO (inf: no target)."""
        slo = request.slo
        if request.first_token_time is None:
            return request.arrival_time + slo.ttft if slo.ttft is not None else math.inf
        return request.first_token_time + slo.tpot * request.num_output_tokens if slo.tpot is not None else math.inf

    def _deadline_bucket(self, request: Request, now: float) -> int:
        return deadline_bucket(self.next_token_deadline(request) - now, self.deadline_buckets)

    def _occupied_bucket(self, request: Request) -> int:
        """KV the request holds, or held before a preemption (§3.2.2: such a GT goes first)."""
        running = request.status == RequestStatus.RUNNING
        occupied = request.num_computed_tokens if running or not request.num_preemptions else request.num_tokens
        return occupied // self.kv_bucket_tokens

    def _gt_key(self, request: Request, now: float) -> tuple:
        """The §3.3 order of the waiting queue; `_queue` keeps it (ties: deque order)."""
        return (self._deadline_bucket(request, now), -self._occupied_bucket(request),
                -self.predicted_rl(request), request.arrival_time)

    def _pt_key(self, request: Request, now: float) -> tuple:
        return (self._deadline_bucket(request, now), -self._occupied_bucket(request),
                -_lacking(request), request.arrival_time)

    def _buckets(self, requests: list[Request], key, now: float) -> list[list[Request]]:
        """`requests` in `key` order, cut into (deadline, occupied) buckets, each sorted by
        descending length: what the bisects search."""
        keyed = sorted(((key(r, now), r) for r in requests), key=lambda kr: kr[0])
        return [[r for _, r in group] for _, group in groupby(keyed, key=lambda kr: kr[0][:2])]

    def _free_kv_tokens(self) -> int:
        return (self.kv.num_blocks - self.kv.num_used_blocks) * self.kv.block_size
