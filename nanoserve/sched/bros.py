"""BROS: hybrid scheduling of real-time (RT, "online") and best-effort (BE, "offline") requests
(bros.txt §4), over bidirectional KV blocks (§5, `nanoserve/memory/bidirectional_kv.py`).

Each step maximises BE work while every RT request's next token can still meet its deadline
(problem (1)-(8), §4.1), with the greedy priority packing of Alg. 1 (§4.2):

    _deadline / _residual   Eq. (6). An RT request's next token is due at arrival + TTFT (no
                            token yet) or last token + TPOT. Its residual is the time each
                            iteration it still needs may take ("assuming the remaining tokens are
                            scheduled in the following iterations consecutively"): slack / the
                            number of token-budget chunks left before it samples.
    _rt_candidates          Alg. 1 lines 3-4 with the request-pulling optimisation (Fig. 8):
                            only the running ("pending") RT requests are sorted by slack; the
                            waiting queue is already in arrival, hence TTFT-deadline, order and
                            is merged in, not sorted (it is sorted only if a preempted or
                            per-request-SLO request breaks that order). The oldest RT request
                            goes first whatever its urgency (progress, see _make_room_for_rt).
    _select_rt              Alg. 1 lines 5-15: add the most urgent RT requests while the batch
                            size (7), the token budget and max_num_seqs allow and the cost model's
                            iteration time (2)-(5) stays within the smallest residual of the RT
                            requests in the batch (6). Adding one that would break it is the SLO
                            risk of lines 11-12: stop, with no BE work this step.
    _be_candidates          Alg. 1 line 17: BE requests by fewest KV slots on the host (their
                            swap-in cost, `missing_positions`); running before waiting on ties.
    _select_be              Alg. 1 lines 18-33: add BE requests while the time budget holds (a
                            BE prefill chunk shrinks to fit it); when the batch is full, a BE
                            request replaces the least urgent RT request that can afford to sit
                            this iteration out.
    _adapt_batch_size       §4.2 adaptive batch sizing (TCP-like): start at `initial_batch_size`,
                            add `batch_size_step` after a step with no SLO risk and no RT request
                            left waiting (except for lack of batch room); back to the start on
                            SLO risk.
    plan                    Packs twice. A draft runs Alg. 1 on paper (no KV touched) to find
                            which RT requests BE requests replace; the real pass packs again
                            without them, reserving KV as it goes, so every RT chunk is reserved
                            before any BE chunk. The bidirectional manager needs that order (RT
                            pages overwrite unpinned BE slots, lazily checkpointed, §5.2), and a
                            request given a chunk this step is never preempted. An RT request
                            the memory cannot take even after evictions is passed over for the
                            next one (FindPreemptBlock found nothing).
    _make_room_for_rt       §5.2's last resort: when an RT request finds no room (or no seat),
                            running requests without a chunk are swapped out: BE ones, newest
                            first, then RT ones younger than it, least urgent first. Only
                            younger: the oldest RT request (first in line) can evict anyone, so
                            it always advances and nothing livelocks.
    _grant_be               A waiting BE request is admitted only where it fits; a running one
                            that cannot grow drops newer BE requests, or itself, as FCFS.

Chunked prefill is as in FCFS: a request takes min(tokens it lacks, budget left).

Refinements the paper leaves open: an RT request already past its deadline cannot be saved by a
smaller batch, so it is served first but does not bound the time budget (it still counts as SLO
risk for the batch size). The cost model does not price KV copies (the paper overlaps swaps with
the forward pass: max(T_exec, T_swap)); swap cost enters only through the BE ordering.
"""
from __future__ import annotations

import heapq
import itertools

from nanoserve.memory.bidirectional_kv import BidirectionalKV
from nanoserve.request import Request, RequestStatus
from nanoserve.sched.base import Scheduler, SchedulerOutput
from nanoserve.sched.bros_batch import INF, Batch, is_rt



class BROSScheduler(Scheduler):
    initial_batch_size = 8  # §4.2 "start with a conservative batch size"
    batch_size_step = 1  # additive increase per step without SLO risk

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.batch_size = self._initial_size()
        self._last_token_time: dict[str, float] = {}  # request id -> when its latest token came
        self._arrivals: dict[str, int] = {}  # request id -> its place in arrival order
        self._count = itertools.count()
        self.slo_risk = False  # whether the last plan hit lines 11-12 (for tests and stats)

    def _initial_size(self) -> int:
        return max(1, min(self.initial_batch_size, self.config.max_num_seqs))

    # -- bookkeeping -----------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self._arrivals[request.request_id] = next(self._count)
        super().add_request(request)

    def update_after_step(self, output: SchedulerOutput) -> None:
        super().update_after_step(output)
        # The engine appends the sampled tokens right after this, at the same clock reading.
        now = self.clock()
        for chunk in output.chunks:
            if chunk.samples:
                self._last_token_time[chunk.request.request_id] = now

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        super().finish_request(request, status)
        self._last_token_time.pop(request.request_id, None)
        self._arrivals.pop(request.request_id, None)

    # -- Eq. (6): deadlines and residual time ------------------------------------------------
    def _deadline(self, request: Request) -> float:
        slo = request.slo
        if request.first_token_time is None:
            return request.arrival_time + slo.ttft if slo.ttft is not None else INF
        if slo.tpot is None:
            return INF
        last = self._last_token_time.get(request.request_id)
        if last is None:  # not seen by this scheduler: assume it kept its TPOT pace
            last = request.first_token_time + slo.tpot * (request.num_output_tokens - 1)
        return last + slo.tpot

    def _residual(self, request: Request, now: float) -> float:
        """Time each iteration may take if `request`'s next token is to be on time."""
        lacking = request.num_tokens - request.num_computed_tokens
        iterations = max(1, -(-lacking // self.config.max_num_batched_tokens))
        return (self._deadline(request) - now) / iterations

    def _host_slots(self, request: Request) -> int:
        if isinstance(self.kv, BidirectionalKV) and self.kv.blocks.has(request.request_id):
            return len(self.kv.blocks.missing_positions(request.request_id))
        return 0

    # -- Alg. 1 lines 3-4, Fig. 8 ----------------------------------------------------------
    def _rt_candidates(self, now: float) -> list[Request]:
        slack = {id(r): self._deadline(r) - now for r in self.running if is_rt(r)}
        for r in self.waiting:
            if is_rt(r):
                slack[id(r)] = self._deadline(r) - now
        pending = sorted((r for r in self.running if is_rt(r)), key=lambda r: slack[id(r)])
        waiting = [r for r in self.waiting if is_rt(r)]
        if any(slack[id(a)] > slack[id(b)] for a, b in zip(waiting, waiting[1:])):
            waiting.sort(key=lambda r: slack[id(r)])  # a preempted request or its own SLO broke the order
        # Poll both queues, always taking the more urgent head (stable: pending first on ties).
        order = list(heapq.merge(pending, waiting, key=lambda r: slack[id(r)]))
        # The oldest RT request leads, whatever its urgency: it may evict any other request, so
        # it always advances, and requests that urgency alone orders cannot evict one another
        # in a loop (a guarantee the paper leaves implicit; FCFS has it for its head).
        if order:
            oldest = min(order, key=self._seniority)
            order.remove(oldest)
            order.insert(0, oldest)
        return order

    def _be_candidates(self) -> list[Request]:
        queued = [r for r in self.running if not is_rt(r)] + [r for r in self.waiting if not is_rt(r)]
        rank = {id(r): (self._host_slots(r), r.status != RequestStatus.RUNNING) for r in queued}
        return sorted(queued, key=lambda r: rank[id(r)])

    # -- the plan ----------------------------------------------------------------------------
    def plan(self) -> SchedulerOutput:
        now = self.clock()
        self.running = self.kv.order(self.running)  # RT first, as the bidirectional manager needs
        # Alg. 1 on paper first (no KV touched): which RT requests BE requests replace.
        draft = Batch(self, now)
        self._select_rt(draft)
        if not draft.stop:
            self._select_be(draft, replace=True)
        # Then for real, reserving as it packs: RT chunks before any BE chunk. An RT request the
        # memory cannot take (even after evictions) is passed over for the next one.
        batch = Batch(self, now, out=SchedulerOutput(), draft=draft)
        capped = self._select_rt(batch, skip=draft.replaced, cap=self.batch_size - len(draft.replaced))
        if not batch.stop:
            self._select_be(batch, replace=False)
        rt_left_waiting = any(is_rt(r) and not batch.holds(r) for r in self.waiting)
        self._adapt_batch_size(batch.risk, capped or not rt_left_waiting)
        self.slo_risk = batch.risk
        return batch.out

    def _select_rt(self, batch: Batch, skip: set[int] = frozenset(), cap: int | None = None) -> bool:
        """Alg. 1 lines 5-15, up to `cap` RT requests (the batch size less the seats the draft
        gave BE requests). Returns whether an RT request was left out for lack of batch room."""
        cap = self.batch_size if cap is None else cap
        for request in self._rt_candidates(batch.now):
            if id(request) in skip or batch.evicted(request):
                continue
            if len(batch) >= cap:
                return True
            num_new = batch.chunk_size(request)
            if num_new == 0:
                break  # the token budget is spent
            residual = self._residual(request, batch.now)
            late = residual <= 0  # already late: served first, but it cannot bound the batch
            residual = INF if late else residual
            if batch.rt and batch.cost_with(request, num_new) > min(batch.budget, residual):
                batch.risk = batch.stop = True  # lines 11-12: it would push someone past a deadline
                break
            if not self._grant_rt(batch, request, num_new, residual):
                continue  # no seat or no KV for it (FindPreemptBlock found nothing)
            batch.risk |= late
            if batch.cost > batch.budget:
                batch.risk = batch.stop = True  # even the most urgent request alone is at risk
                break
        return False

    def _select_be(self, batch: Batch, replace: bool) -> None:
        """Alg. 1 lines 17-33."""
        for request in self._be_candidates():
            if batch.tokens_left <= 0:
                break
            if batch.evicted(request):
                continue
            replaced = None
            if len(batch) >= self.batch_size:
                replaced = self._replace_least_urgent_rt(batch) if replace else None
                if replaced is None:
                    break
            num_new = batch.largest_chunk_within_budget(request)
            if num_new > 0 and self._grant_be(batch, request, num_new):
                continue
            if replaced is not None:
                batch.restore(replaced)  # the swap would not fit the time budget: undo it
                break

    def _replace_least_urgent_rt(self, batch: Batch):
        """Take out the least urgent RT request (never the most urgent) that can sit this
        iteration out: after it, each iteration it still needs may take as long as this one."""
        est = batch.cost
        for request in reversed(batch.rt[1:]):
            deadline = self._deadline(request)
            lacking = request.num_tokens - request.num_computed_tokens
            iterations = max(1, -(-lacking // self.config.max_num_batched_tokens))
            if deadline < INF and (deadline - batch.now - est) / iterations >= est:
                return batch.remove(request)
        return None

    def _adapt_batch_size(self, risk: bool, may_grow: bool) -> None:
        """§4.2: additive increase while no RT request waits (except for batch room), reset on
        SLO risk."""
        if risk:
            self.batch_size = self._initial_size()
        elif may_grow:
            self.batch_size = min(self.batch_size + self.batch_size_step, self.config.max_num_seqs)

    # -- reserving KV: RT first, then BE -----------------------------------------------------
    def _grant_rt(self, batch: Batch, request: Request, num_new: int, residual: float) -> bool:
        if batch.out is None:  # the draft: seats counted, KV not
            if not batch.has_seat(request):
                return False
        elif not self._make_room_for_rt(batch, request, num_new):
            return False
        batch.add(request, num_new, residual)
        return True

    def _grant_be(self, batch: Batch, request: Request, num_new: int) -> bool:
        if batch.out is None:
            if not batch.has_seat(request):
                return False
        elif request.status == RequestStatus.WAITING:
            # Admit new BE work only where it fits as things are; never evict for it.
            if len(self.running) >= self.config.max_num_seqs or not self.can_chunk(request, num_new):
                return False
        else:
            # A running BE request that cannot grow drops newer BE requests, or itself (as FCFS).
            while not self.can_chunk(request, num_new):
                victim = next((r for r in reversed(self.running) if not is_rt(r) and not batch.holds(r)), None)
                if victim is None:
                    return False
                self._evict(batch, victim)
                if victim is request:
                    return False
        batch.add(request, num_new)
        return True

    def _make_room_for_rt(self, batch: Batch, request: Request, num_new: int) -> bool:
        """Swap out running requests without a chunk this step until `request` fits: BE ones,
        newest first, then RT ones younger than it, least urgent first (§5.2); those the draft
        did not plan to serve before those it did."""
        waiting = request.status == RequestStatus.WAITING
        while ((waiting and len(self.running) >= self.config.max_num_seqs)
               or not self.can_chunk(request, num_new)):
            victim = self._rt_victim(batch, request)
            if victim is None:
                return False
            self._evict(batch, victim)
        return True

    def _rt_victim(self, batch: Batch, request: Request) -> Request | None:
        spare = [r for r in self.running if not batch.holds(r) and r is not request]
        be = [r for r in reversed(spare) if not is_rt(r)]  # newest first
        # RT victims are only ever younger than the request: the oldest RT request can never be
        # evicted, so RT requests cannot evict each other in a loop (urgency alone could).
        mine = self._seniority(request)
        rt = sorted((r for r in spare if is_rt(r) and self._seniority(r) > mine), key=self._deadline, reverse=True)
        for group in (be, rt):
            if group:
                return min(group, key=batch.draft.holds)  # stable: the first one not planned, if any
        return None

    def _seniority(self, request: Request) -> tuple[float, int]:
        return request.arrival_time, self._arrivals.get(request.request_id, 0)

    def _evict(self, batch: Batch, victim: Request) -> None:
        self.running.remove(victim)
        self.preempt(victim)
        batch.out.preempted.append(victim)
        batch.gone.add(id(victim))
