"""EcoServe's scheduling (ecoserve.txt §3): SyncDecoupled batching with Ordering, over exact
allocation (`memory/exact_kv.py`, the policy's default KV manager).

The paper splits each request into its prompt task (PT) and its generation task (GT), and gives
each resource to one of them (§3.2.1): "PTs and GTs are responsible for fully utilizing the GPU and
KVC, respectively." A PT is allocated its prompt's KV; when its prompt is done it becomes a GT in
the GT queue, and a GT is allocated its predicted RL when it is batched. One step of Algorithm 1
(§3.5) maps onto `plan` as follows:

    Alg. 1 / paper                           here
    ---------------------------------------  ----------------------------------------------------
    lines 7-9: "the GTs generated from the   `_enter_generation_queue`: a running PT whose prompt
    prompts and preempted GTs are inserted   is done (the step sampled its first token) leaves
    into the GT queue"                       the batch for Q_G, its prompt KV held; a GT that
                                             paused (below) is already there
    the running batch's GTs advance one      `_serve_running`: every batched GT gets one token, in
    token each (time-synced groups, §3.2.2)  the manager's order (hosts before guests, §3.4)
    under-prediction (§3.2.2): "it first     the manager charges growth past the allocation to the
    tries to use the reserved KVC. If the    reserved pool; a GT it says cannot grow is paused
    reserved KVC is not enough, this         (`preempt(keep_resident=True)`): it keeps its KV and
    request stops processing"                re-enters Q_G with L_new
    line 2: "Select GT groups from Q_G       `_batch_generations`: Q_G (`_generations`), grouped by
    until Σ L_r = A_KVC"                     equal predicted RL, in §3.3 order; bisect for the
                                             group whose RL is closest below A_KVC
                                             (`admission_room_tokens`); a group that does not fit
                                             whole is split. Each batched GT decodes at once
    line 3: hosted GTs (KVCPipeline, §3.4)   the manager places a batched GT in a host's unused
                                             allocation when one fits, so a GT longer than A_KVC
                                             is still tried
    line 5: "Select PTs from Q_P until       `_fill_prompts`: running PTs go on first (their KV is
    Σ L_p = TFS"                             held), then Q_P (`_prompts`) in §3.3 order: bisect for
                                             the longest whole prompt that fits what is left of
                                             the TFS, else a chunk of the one closest above. The
                                             manager gives a PT its prompt's KV from the reserved
                                             pool ("A small amount KVC is reserved for PTs")
    Ordering (§3.3)                          `_queue_arrivals` keys a request once as it joins
                                             either queue (only its deadline bucket moves while it
                                             waits, and `advance` moves just those)

Ordering (§3.3), for both queues: ascending deadline bucket (`deadline`: §4's JCT SLO, arrival
+ SLO-scale x (t_p + t_g x predicted RL), when the request's SLO sets one; slack < 0.5 s, < 2 s,
later, no target), then descending occupied-KV bucket (tokens whose KV
the request holds, in `kv_bucket_tokens` ranges: a paused GT's prompt and generated tokens),
then descending length (predicted RL for GTs, remaining prompt for PTs), then arrival; ties keep
the waiting deque's order (preempted requests at its front). Within one (deadline, occupied)
bucket the tasks are thus sorted by length, and `bisect` finds the one closest below the room left.

Adaptations to this framework (ours):
- Both queues are `self.waiting` for the engine: a waiting request that holds the K/V of all its
  tokens but the last (one token lacking) is a GT; any other is a PT (a new prompt, or one whose
  KV was dropped and is recomputed as prompt).
- Q_G is batched every step there is room, not only "if a GT group completes": room appears
  when any GT finishes, and §3.2.1 batches "If there is available KVC".
- The TFS is the largest token count whose predicted iteration time (cost model, one prefill
  chunk at prefix 0 next to the decodes) stays under `tfs_target` (default: the online TPOT
  target, since every iteration is one decode step of every running GT), capped by the token
  budget; prompts always get at least `min_prefill_tokens` so they advance under any target.
  Decodes are never cut by the TFS.
- Liveness: paused GTs hold KV while they wait, so when nothing runs and no GT in Q_G can be
  batched, the one holding least KV is dropped to be recomputed (`queued_drops`); the paper
  does not say what happens then.
- A request whose SLO sets no JCT target (the engine's online default: TTFT and TPOT) is ranked
  by the deadline of its next token instead: arrival + TTFT before the first token, then first
  token + TPOT per later one.

Fig. 11's ablation (§4 "Compared Methods") switches the mechanisms off one at a time, as policy
options (`OPTIONS`) and the KV manager's `pipelining`:

    EcoServe-D    ordering=False, synced=False  "decouples prompt and GT processing, selects tasks
                  pipelining=False               sequentially from the two queues ... and uses the
                                                 exact-allocation": both queues FCFS, each GT alone
    EcoServe-SD   ordering=False, synced=True   "SyncDecouple": FCFS, but a GT is batched with the
                  pipelining=False               GTs of its predicted RL (its group, §3.2.2)
    EcoServe-SDO  ordering=True, pipelining=False  "further incorporates the Ordering method"
    EcoServe      all on                        + KVCPipeline (§3.4)

With `ordering` on, §3.3's sort by predicted RL keeps a group together by itself: its members are
adjacent and the bisect takes them in turn until the room is less than their RL (a split).
"""
from __future__ import annotations

import math
import time
from bisect import bisect_right
from collections.abc import Callable

from nanoserve.config import SchedulerConfig
from nanoserve.memory.blocks import BlockPool
from nanoserve.memory.manager import KVManager
from nanoserve.request import Request, RequestStatus
from nanoserve.sched.base import Scheduler
from nanoserve.sched.cost_model import CostModel
from nanoserve.sched.ecoserve_queue import TaskQueue, deadline_bucket
from nanoserve.sched.output import SchedulerOutput


def _lacking(request: Request) -> int:
    return request.num_tokens - request.num_computed_tokens


def _is_generation(request: Request) -> bool:
    """A GT: it holds the K/V of every token but the one it will decode next."""
    return request.num_computed_tokens > 0 and len(request.token_ids) - request.num_computed_tokens == 1


class EcoServeScheduler(Scheduler):
    OPTIONS = {
        "tfs_target": "seconds one iteration may take, the TFS's bound (default: the online TPOT target; "
                      "null: the token budget alone)",
        "ordering": "§3.3's Ordering (default true); false: both queues FCFS, tasks taken in sequence "
                    "(Fig. 11's EcoServe-D and -SD)",
        "synced": "with ordering false: batch a GT with the queued GTs of its predicted RL (true, the default: "
                  "Fig. 11's EcoServe-SD) or alone (false: EcoServe-D)",
        "group_tokens": "the resolution at which two predicted RLs are equal for grouping (default: the KV block "
                        "size)",
    }
    deadline_buckets: tuple[float, ...] = (0.5, 2.0)  # §3.3's slack ranges, seconds
    kv_bucket_tokens: int = 128  # §3.3's magnitude ranges for occupied KV
    min_prefill_tokens: int = 16  # prompts advance even when decodes alone exceed the TFS target
    max_failed_admissions: int = 32  # refusals per queue per step before it gives up

    def __init__(self, config: SchedulerConfig, kv: KVManager | BlockPool, cost_model: CostModel | None = None,
                 clock: Callable[[], float] = time.monotonic, tfs_target: float | None | str = "online_tpot"):
        super().__init__(config, kv, cost_model, clock)
        options = config.policy_options
        tfs_target = options.get("tfs_target", tfs_target)
        # Seconds one iteration may take: by default the online TPOT target (None: no time cap).
        self.tfs_target = config.online_slo.tpot if tfs_target == "online_tpot" else tfs_target
        self.ordering = bool(options.get("ordering", True))
        self.synced = bool(options.get("synced", True))
        # assumption: RLs are "the same" when they fill the same number of KV blocks ("the KVC
        # allocation is still in the unit of a block", §3.2.1). The paper's predictor makes groups
        # (Fig. 2: 59-61% of ShareGPT's and Alpaca's requests in groups of 4 or more); one that
        # predicts to the token would make almost none.
        self.group_tokens = int(options.get("group_tokens", self.kv.block_size))
        # Q_P and Q_G: `self.waiting` indexed by §3.3's keys. Requests that joined `self.waiting`
        # since the last pass wait in `_unqueued` (True: at the deque's front), in deque order, and
        # are keyed at the next one: that is when a full re-sort would have asked the predictor.
        self._prompts = TaskQueue(self.deadline_buckets)
        self._generations = TaskQueue(self.deadline_buckets)
        self._unqueued: dict[Request, bool] = {}
        self._batched: set[Request] = set()  # running GTs; a running request not in it is a PT
        self.queued_drops = 0  # GTs whose KV was dropped because nothing else could run (ours)
        self.group_batches = 0  # GTs batched with a group-mate by `_batch_group_of` (EcoServe-SD)

    # -- the waiting queues: `self.waiting` for the engine and base class, two indexes for the order
    def add_request(self, request: Request) -> None:
        super().add_request(request)
        self._unqueued[request] = False

    def preempt(self, request: Request, keep_resident: bool = False) -> bool:
        kept = super().preempt(request, keep_resident)
        self._batched.discard(request)
        self._unqueued[request] = True
        return kept

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        self._unindex(request)
        self._batched.discard(request)
        super().finish_request(request, status)

    def _unindex(self, request: Request) -> None:
        if request in self._unqueued:
            del self._unqueued[request]
        elif request in self._generations:
            self._generations.remove(request)
        elif request in self._prompts:
            self._prompts.remove(request)

    def _queue_arrivals(self, now: float) -> None:
        self._prompts.advance(now)  # first: arrivals are placed by their slack at `now`
        self._generations.advance(now)
        for request, at_front in self._unqueued.items():
            generation = _is_generation(request)
            queue = self._generations if generation else self._prompts
            if not self.ordering:  # Fig. 11's -D and -SD: one group, in arrival order (deque order on ties)
                queue.add(request, deadline=math.inf, occupied_bucket=0, length=0, at_front=at_front)
                continue
            queue.add(request, deadline=self.deadline(request), occupied_bucket=self._occupied_bucket(request),
                      length=self.predicted_rl(request) if generation else _lacking(request), at_front=at_front)
        self._unqueued.clear()

    def _dequeue(self, queue: TaskQueue, request: Request) -> None:
        queue.remove(request)
        self.waiting.remove(request)
        self.admit(request)

    # -- the step (Algorithm 1) ------------------------------------------------------------
    def plan(self) -> SchedulerOutput:
        out = SchedulerOutput()
        now = self.clock()
        self._enter_generation_queue()
        budget = self.config.max_num_batched_tokens
        budget -= self._serve_running(out, budget)
        self._queue_arrivals(now)  # after the pauses: a paused GT may be batched again at once
        self._admit(out, budget)
        while not out.chunks and not self.running and len(self._generations):
            self._drop_a_queued_generation()
            self._queue_arrivals(now)
            self._admit(out, budget)
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        """GTs from Q_G to fill the KV, then PTs to reach the TFS (Alg. 1 lines 2-5)."""
        budget -= self._batch_generations(out, budget)
        decodes = [(c.start, 1) for c in out.chunks]
        tfs = self.target_forward_size(decodes)
        self._fill_prompts(out, min(budget, max(tfs - len(decodes), self.min_prefill_tokens)))

    def _enter_generation_queue(self) -> None:
        """Alg. 1 lines 7-9: a PT whose prompt is done becomes a GT in Q_G, keeping its prompt KV."""
        done = [r for r in self.running if r not in self._batched and _is_generation(r)]
        for request in done:
            self.running.remove(request)
            request.status = RequestStatus.WAITING
            self.waiting.append(request)
            self._unqueued[request] = False

    def _serve_running(self, out: SchedulerOutput, budget: int) -> int:
        """Every batched GT decodes one token (the first `budget` of them), in the manager's order;
        one the manager cannot grow pauses (§3.2.2) and waits in Q_G with L_new. Returns the tokens."""
        self.running = self.kv.order(self.running)
        served = 0
        for request in list(self.running):
            # A batched GT lacking more than one token recomputes a dropped guest's KV: a prompt.
            if served >= budget or request not in self._batched or _lacking(request) != 1:
                continue
            chunk = self.try_chunk(request, 1)
            if chunk is None:
                self.running.remove(request)
                self.preempt(request, keep_resident=True)
                out.preempted.append(request)
                continue
            out.chunks.append(chunk)
            served += 1
        return served

    def _batch_generations(self, out: SchedulerOutput, budget: int) -> int:
        """Alg. 1 lines 2-3: equal-RL GT groups from Q_G, in §3.3 order, until A_KVC is allocated (or
        a host's region holds them); each batched GT decodes at once. Returns the tokens."""
        failures, used, room = 0, 0, self.kv.admission_room_tokens()
        for group in self._generations.groups():
            refused: set[Request] = set()  # by the manager this step: passed over, as if popped
            while used < budget and len(self.running) < self.config.max_num_seqs:
                # The group whose RL is closest below A_KVC; if none, the shortest (it may still be
                # hosted in a running GT's unused allocation, §3.4).
                request = self._generations.closest_below(group, room, refused)
                if request is None:
                    break
                if failures >= self.max_failed_admissions:
                    return used
                chunk = self.try_chunk(request, 1)
                if chunk is None:
                    failures += 1
                    refused.add(request)
                    continue
                self._dequeue(self._generations, request)
                self._batched.add(request)
                out.chunks.append(chunk)
                used += 1
                if not self.ordering and self.synced:  # EcoServe-SD: the rest of its group next
                    used += self._batch_group_of(request, group, out, budget - used)
                room = self.kv.admission_room_tokens()
        return used

    def _batch_group_of(self, first: Request, group: tuple[int, int], out: SchedulerOutput, budget: int) -> int:
        """Fig. 11's EcoServe-SD (FCFS queues): batch the queued GTs with `first`'s predicted RL (to
        `group_tokens`), in
        arrival order, until one does not fit ("If the KVC's available space cannot accommodate an
        entire group, the group needs to split", §3.2.1). Returns the tokens."""
        def rl_group(request: Request) -> int:
            return -(-self.predicted_rl(request) // self.group_tokens)

        rl, used = rl_group(first), 0
        for request in [r for r in self._generations.members(group) if rl_group(r) == rl]:
            if used >= budget or len(self.running) >= self.config.max_num_seqs:
                break
            chunk = self.try_chunk(request, 1)
            if chunk is None:
                break
            self._dequeue(self._generations, request)
            self._batched.add(request)
            out.chunks.append(chunk)
            used += 1
            self.group_batches += 1
        return used

    def counters(self) -> dict[str, int]:
        return {"queued_drops": self.queued_drops, "group_batches": self.group_batches}

    def _fill_prompts(self, out: SchedulerOutput, budget: int) -> None:
        """Alg. 1 line 5: PTs until the TFS is reached: the running ones (their prompt KV is held),
        then Q_P in §3.3 order; in each bucket the longest prompt that fits whole (bisect), else a
        chunk of the one closest above."""
        for request in list(self.running):
            if budget <= 0:
                return
            # Running and not batched: a PT (a finished one went to Q_G). Batched and lacking
            # more than one token: a GT recomputing a dropped guest's KV.
            if request not in self._batched or _lacking(request) > 1:
                num_new = min(_lacking(request), budget)
                chunk = self.try_chunk(request, num_new)
                if chunk is None:  # a dropped guest that cannot be restored now: recomputed later
                    self.running.remove(request)
                    self.preempt(request)
                    out.preempted.append(request)
                    continue
                out.chunks.append(chunk)
                budget -= num_new
        self._admit_prompts(out, budget)

    def _admit_prompts(self, out: SchedulerOutput, budget: int) -> None:
        """New PTs from Q_P within `budget` tokens; the manager gives each its prompt's KV."""
        failures = 0
        for group in self._prompts.groups():
            refused: set[Request] = set()
            while budget > 0 and len(self.running) < self.config.max_num_seqs:
                request = self._prompts.closest_below(group, budget, refused)
                if request is None:
                    break
                if failures >= self.max_failed_admissions:
                    return
                num_new = min(_lacking(request), budget)
                chunk = self.try_chunk(request, num_new)
                if chunk is None:
                    failures += 1
                    refused.add(request)
                    continue
                self._dequeue(self._prompts, request)
                out.chunks.append(chunk)
                budget -= num_new

    def _drop_a_queued_generation(self) -> None:
        """Nothing runs and no waiting GT could be batched (paused GTs hold the KV): drop the KV
        of the one holding least, to be recomputed as a PT (ours: liveness)."""
        victim = min(self._generations.requests(), key=lambda r: (r.num_computed_tokens, -r.arrival_time))
        self._generations.remove(victim)
        kept, copies = self.kv.preempt(victim)
        self._add_copies(copies)
        victim.num_computed_tokens = kept
        self.waiting.remove(victim)  # to the front, as a preemption puts it
        self.waiting.appendleft(victim)
        self._unqueued[victim] = True
        self.queued_drops += 1

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

    # -- Ordering (§3.3) -------------------------------------------------------------------
    def predicted_rl(self, request: Request) -> int:
        """The request's predicted response length, as the KV manager allocates it (exact_kv: the
        predictor's, or L_new after a preemption; others: what max_tokens allows). Fixed while
        the request waits: the queue asks once, when the request joins it."""
        return self.kv.predicted_output_len(request)

    def deadline(self, request: Request) -> float:
        """§3.3: "Each task has a deadline to satisfy its SLO", the JCT SLO of §4: arrival +
        SLO-scale x (t_p + t_g x l_g), l_g the RL the KV manager predicts for it (after a pause,
        the tokens so far and L_new). A paused GT keeps its arrival, so it ranks ahead of fresh GTs
        that arrived later: "This request won't wait long in the queue because it occupies a
        certain KVC and will be given a higher priority in the queue ordering method" (§3.2.2).
        With no JCT target in the request's SLO (ours): `next_token_deadline`."""
        jct = request.slo.jct_target(self.kv.predicted_total_output_len(request))
        return request.arrival_time + jct if jct is not None else self.next_token_deadline(request)

    def next_token_deadline(self, request: Request) -> float:
        """When the request's next token is due under its TTFT/TPOT targets (inf: no target)."""
        slo = request.slo
        if request.first_token_time is None:
            return request.arrival_time + slo.ttft if slo.ttft is not None else math.inf
        return request.first_token_time + slo.tpot * request.num_output_tokens if slo.tpot is not None else math.inf

    def _deadline_bucket(self, request: Request, now: float) -> int:
        return deadline_bucket(self.deadline(request) - now, self.deadline_buckets)

    def _occupied_bucket(self, request: Request) -> int:
        """KV the request holds (§2.4: a waiting GT's prompt, and its generated tokens if it was
        preempted; such a GT goes first, §3.2.2)."""
        return request.num_computed_tokens // self.kv_bucket_tokens
