"""BROS: hybrid scheduling of real-time (RT, "online") and best-effort (BE, "offline") requests
(bros.txt §4), over bidirectional KV blocks (§5, `nanoserve/memory/bidirectional_kv.py`).

Each step maximises BE work while every RT request's next token can still meet its deadline
(problem (1)-(8), §4.1), with the greedy priority packing of Alg. 1 (§4.2):

    due, _pack_rt           Eq. (6). An RT request's next token is due at arrival + TTFT (no
                            token yet) or last token + TPOT (`bros_queue.Deadlines`, kept as
                            tokens come). Its residual is the time each iteration it still needs
                            may take ("assuming the remaining tokens are scheduled in the
                            following iterations consecutively"): slack / the number of
                            token-budget chunks left before it samples.
    _rt_candidates          Alg. 1 lines 3-4 with request pulling (Fig. 8; `bros_queue.py`): only
                            the running ("pending") RT requests are sorted; waiting ones are
                            pulled from a heap filed by deadline as they join the queue, only as
                            many as the batch takes (preempted and per-request-SLO requests
                            included). The oldest RT request goes first whatever its urgency
                            (progress, see _make_room_for_rt).
    _select_rt              Alg. 1 lines 5-15: add the most urgent RT requests while the batch
                            size (7), the token budget and max_num_seqs allow and the cost model's
                            iteration time (2)-(5) stays within the smallest residual of the RT
                            requests in the batch (6). Memory comes first: a waiting RT request
                            that could not get KV even after the BE evictions _make_room_for_rt
                            would make is passed over before its cost is weighed (Alg. 1 packs
                            "until ... no empty and preemptible cache blocks ... exist"; an
                            assumption, `no_kv_waiting`), and so is one without a seat. Adding
                            one that would break the budget is the SLO risk of lines 11-12:
                            stop, with no BE work this step.
    _be_candidates          Alg. 1 line 17: BE requests by fewest KV slots on the host (their
                            swap-in cost, `missing_positions`); running before waiting on ties.
                            Only checkpointed or swapped requests have any: the running ones are
                            sorted, the waiting ones pulled from a heap.
    _select_be              Alg. 1 lines 18-33: add BE requests while the time budget holds (a
                            BE prefill chunk shrinks to fit it); when the batch is full, a BE
                            request replaces the least urgent RT request that can afford to sit
                            this iteration out.
    _adapt_batch_size       §4.2 adaptive batch sizing (TCP-like): start at `initial_batch_size`,
                            grow (x2 by default) after every step that did not return early
                            at lines 11-12; back to the start on SLO risk ("once the estimated
                            iteration time surpasses the residual time").
    plan                    Packs twice. A draft runs Alg. 1 on paper (no KV touched) to find
                            which RT requests BE requests replace; the real pass packs again
                            without them, reserving KV as it goes, so every RT chunk is reserved
                            before any BE chunk. The bidirectional manager needs that order (RT
                            pages overwrite unpinned BE slots, lazily checkpointed, §5.2), and a
                            request given a chunk this step is never preempted. An RT request
                            the memory cannot take even after evictions is passed over for the
                            next one (FindPreemptBlock found nothing).
    _replay_rt, _replay_be  The real pass replays the draft's decisions where they provably carry
                            over (each chunk fits as it is, no decision hinged on the replaced RT
                            requests); the first request that needs more hands over to the usual
                            packing, past the requests already packed.
    _make_room_for_rt       §5.2's last resort: when an RT request finds no room (or no seat),
                            running requests without a chunk are swapped out: BE ones, newest
                            first, then RT ones younger than it, least urgent first. Only
                            younger: the oldest RT request (first in line) can evict anyone, so
                            it always advances and nothing livelocks.
    _grant_be               A waiting BE request is admitted only where it fits; a running one
                            that cannot grow drops newer BE requests, or itself, as FCFS.

Chunked prefill is as in FCFS: a request takes min(tokens it lacks, budget left); a BE prefill
chunk also shrinks to fit the time budget. That is ours: the paper prefills whole prompts and
argues against chunking for TTFT (§1: "Sarathi-Serve adopts chunked-prefills ... but delays the
return of the initial context (TTFT)"). The option prefill='whole' does as the paper does: a
prompt (or a recompute) of up to max_num_batched_tokens runs in one step, or waits for a step
whose token and time budgets hold it whole; a longer one is still chunked (it could never run).

Assumptions (the paper's text lost both symbols: "start with a conservative batch size, e.g.,
." and "we increase the batch size: to include more BE requests"): the initial batch size is 8
and it doubles per step (TCP's slow start; §4.2 names TCP's window as its model). Both are
policy options (`OPTIONS`: initial_batch_size, batch_growth '+N' or 'xN'), swept in RESULTS.md.

Our additions, which the paper does not have:
- Late requests are exempt from the budget and from risk. An RT request that misses its
  deadline even alone in a batch (residual below its own chunk's cost) cannot be saved by a
  smaller batch, so it is served first but neither bounds the time budget nor counts as SLO
  risk. Counted, it reset the batch size to 8 nearly every step once requests ran late, and the
  small batches made everything later: a load vLLM serves at 100% TPOT attainment never drained
  (the bros experiment, seed 1).
- The oldest RT request goes first whatever its urgency, and an RT request evicts only younger
  RT requests, so the oldest always advances: a livelock guard (`_rt_candidates`, `_rt_victim`).
- A waiting RT request never evicts a running RT request. §5.2 drops "first BE, then RT, based
  on the remaining time"; we let only a running RT request that cannot grow evict (younger) RT
  requests, because admissions that evicted RT requests threw away half-done prefills in a loop
  under memory pressure.
- Counters of each branch (`counters`): plans, the batch size bound (7) meeting a candidate,
  SLO-risk resets, RT requests a BE request replaced, the mean bound and batch composition, for
  the experiments to show where each mechanism acts.
- The cost model prices T_exec only, not §4.1's max(T_exec, T_swap) with a profiled linear
  T_swap: swap cost enters only through the BE ordering. The engine does overlap the copies
  (`EngineArgs.layerwise_kv_copies`, which the experiments turn on for BROS: a step's copies
  stream layer by layer under its forward), and there T_swap rarely wins: in the bros
  experiment (Fig. 10(a), 10 req/s) forwards waited 0.19 s in 600 s for copies, against 43 s
  of copies on the link.
"""
from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from collections.abc import Set as AbstractSet
from typing import Any

from nanoserve.request import Request, RequestStatus
from nanoserve.sched.base import Scheduler
from nanoserve.sched.bros_batch import INF, WAITING, Batch, is_rt
from nanoserve.sched.bros_queue import PulledQueues
from nanoserve.sched.output import SchedulerOutput

# The keys of `BROSScheduler.counters` (ours): how often each branch ran.
COUNTERS = ("plans", "batch_size_sum", "batch_size_below_max", "rt_held_sum", "be_held_sum", "slo_risk", "size_bound",
            "be_replaced_rt", "be_replace_plans")


def _growth(spec: str) -> tuple[int, int]:
    """'+N' -> (N, 1): add N; 'xN' -> (1, N): multiply by N."""
    kind, number = spec[:1], spec[1:]
    if kind not in ("+", "x") or not number.isdigit() or int(number) < (1 if kind == "+" else 2):
        raise ValueError(f"batch_growth must be '+N' (N >= 1) or 'xN' (N >= 2), not {spec!r}")
    return (int(number), 1) if kind == "+" else (1, int(number))


class BROSScheduler(Scheduler):
    OPTIONS = {"initial_batch_size": "§4.2's lost initial batch size (default 8)",
               "batch_growth": "§4.2's lost increase per step without SLO risk: '+N' adds N, 'xN' multiplies "
                               "by N (default 'x2')",
               "prefill": "'chunked' (ours, the default: a prompt takes what the budgets leave) or 'whole' "
                          "(the paper's: a prompt runs in one step or waits)",
               "replace_rt": "Alg. 1 lines 18-33: when the batch is full, a BE request replaces the least urgent "
                             "RT request that can sit the iteration out (default true; false: an ablation, ours)",
               "no_kv_waiting": "a waiting RT request that no KV can take, even after BE evictions: 'pass' (the "
                                "default: the next waiting one may still join) or 'close' (no later waiting RT "
                                "request joins this step: Alg. 1 read literally)"}
    # Alg. 1 packs RT requests "until ... no empty and preemptible cache blocks ... exist", and
    # request pulling assumes "the waiting queue is inherently ordered". Neither says whether a
    # waiting RT request too large for the free blocks stops the packing or is passed over.
    # assumption: passed over ('pass'), so a smaller one behind it may use the blocks; 'close'
    # is the literal reading. At capacity this choice decides Fig. 13 (RESULTS.md).
    NO_KV_WAITING = ("pass", "close")
    # §4.2 "start with a conservative batch size, e.g., ." assumption: 8 (the symbol is lost).
    initial_batch_size = 8
    # Increase per step without SLO risk: "we increase the batch size: to include more BE
    # requests" (the formula is lost). assumption: x2, TCP's slow start, since §4.2 names TCP's
    # window as its model. TCP's additive increase (+1 per step, `batch_growth` '+1') was our
    # earlier reading: from 8, it left BROS with ~20-request batches beside 140 running requests
    # and 468 requests unfinished in the CI-scale `all` run, where x2 finished all of them (see
    # RESULTS.md for the sweep of both symbols).
    batch_size_step = 1  # added when batch_size_factor is 1
    batch_size_factor = 2  # > 1: multiply by it instead

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.queues = PulledQueues()  # request pulling (Fig. 8): Alg. 1's candidates in order
        options = self.config.policy_options
        if "initial_batch_size" in options:
            self.initial_batch_size = int(options["initial_batch_size"])
            if self.initial_batch_size < 1:
                raise ValueError("initial_batch_size must be >= 1")
        if "batch_growth" in options:
            self.batch_size_step, self.batch_size_factor = _growth(str(options["batch_growth"]))
        prefill = options.get("prefill", "chunked")
        if prefill not in ("chunked", "whole"):
            raise ValueError(f"prefill must be 'chunked' or 'whole', not {prefill!r}")
        self.whole_prompts = prefill == "whole"
        replace_rt = options.get("replace_rt", True)
        if not isinstance(replace_rt, bool):
            raise ValueError(f"replace_rt must be true or false, not {replace_rt!r}")
        self.replace_rt = replace_rt
        no_kv_waiting = options.get("no_kv_waiting", self.NO_KV_WAITING[0])
        if no_kv_waiting not in self.NO_KV_WAITING:
            raise ValueError(f"no_kv_waiting must be one of {', '.join(self.NO_KV_WAITING)}, not {no_kv_waiting!r}")
        self.close_on_no_kv = no_kv_waiting == "close"
        self.batch_size = self._initial_size()
        self.slo_risk = False  # whether the last plan hit lines 11-12 (for tests and stats)
        # How often each branch of Alg. 1 and §4.2 ran (ours; `counters`).
        self._counts = dict.fromkeys(COUNTERS, 0)

    def _initial_size(self) -> int:
        return max(1, min(self.initial_batch_size, self.config.max_num_seqs))

    # -- the queues: the base class's, and request pulling's heaps kept in step with them -----
    def add_request(self, request: Request) -> None:
        super().add_request(request)
        self.queues.add(request, self.kv.host_slots)

    def preempt(self, request: Request, keep_resident: bool = False) -> bool:
        kept = super().preempt(request, keep_resident)
        self.queues.preempt(request, self.kv.host_slots)
        return kept

    def admit(self, request: Request) -> None:
        super().admit(request)
        self.queues.admit(request)

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        super().finish_request(request, status)
        self.queues.finish(request)

    def update_after_step(self, output: SchedulerOutput) -> None:
        super().update_after_step(output)
        # The engine appends the sampled tokens right after this, at the same clock reading.
        self.queues.sampled(output, self.clock())

    def _rt_candidates(self, waiting_closed: Callable[[], bool] = lambda: False) -> Generator[Request, None, None]:
        """Alg. 1 lines 3-4 (`PulledQueues.rt_candidates`) over the running requests."""
        return self.queues.rt_candidates(self.running, waiting_closed)

    def _be_candidates(self) -> Generator[Request, None, None]:
        """Alg. 1 line 17 (`PulledQueues.be_candidates`) over the running requests."""
        return self.queues.be_candidates(self.running, self.kv.host_positions)

    # -- the plan ----------------------------------------------------------------------------
    def plan(self) -> SchedulerOutput:
        now = self.clock()
        self.queues.sync(self.waiting, self.kv.host_slots)
        self.running = self.kv.order(self.running)  # RT first, as the bidirectional manager needs
        # Alg. 1 on paper first (no KV touched): which RT requests BE requests replace.
        draft = Batch(self, now)
        self._select_rt(draft)
        draft.rt_stop, draft.host_version = draft.stop, self.kv.host_slots_version()
        if not draft.stop:
            self._select_be(draft, replace=self.replace_rt)
        # Then for real, reserving as it packs: RT chunks before any BE chunk. An RT request the
        # memory cannot take (even after evictions) is passed over for the next one. Where the
        # memory takes each chunk as it is, the real pass decides as the draft did: replay it.
        out = SchedulerOutput()
        batch = Batch(self, now, out=out, draft=draft)
        replayed = self._replay_rt(batch, draft)
        replay_be = replayed and draft.host_version == self.kv.host_slots_version()
        if not replayed:
            self._select_rt(batch, skip=draft.replaced | batch.held, cap=self.batch_size - len(draft.replaced))
        if not batch.stop:
            if not (replay_be and self._replay_be(batch, draft)):
                self._select_be(batch, replace=False, skip=set(batch.held))
        self._count(draft, batch)
        self._adapt_batch_size(batch.risk)
        self.slo_risk = batch.risk
        return out

    def _count(self, draft: Batch, batch: Batch) -> None:
        """Tally this plan's branches (ours, for the experiments' reports): the draft's, where
        Alg. 1's decisions are taken (the real pass replays or re-packs without the replaced)."""
        counts = self._counts
        counts["plans"] += 1
        counts["batch_size_sum"] += self.batch_size
        counts["batch_size_below_max"] += self.batch_size < self.config.max_num_seqs
        counts["slo_risk"] += batch.risk
        counts["size_bound"] += draft.size_bound
        counts["be_replaced_rt"] += len(draft.replaced)
        counts["be_replace_plans"] += bool(draft.replaced)
        counts["rt_held_sum"] += len(batch.rt)
        counts["be_held_sum"] += len(batch.be)

    def counters(self) -> dict[str, int]:
        """`COUNTERS`: plans; the sum over plans of the batch size bound (7) and of the RT and BE
        requests given a chunk; plans whose bound was below max_num_seqs; plans with SLO risk (lines
        11-12, which reset the bound); plans in which (7) met a candidate (`Batch.size_bound`);
        RT requests a BE request replaced (lines 18-33), and the plans with any."""
        return dict(self._counts)

    def _select_rt(self, batch: Batch, skip: AbstractSet[int] = frozenset(), cap: int | None = None) -> None:
        """Alg. 1 lines 5-15, up to `cap` RT requests (the batch size less the seats the draft
        gave BE requests)."""
        cap = self.batch_size if cap is None else cap
        candidates = self._rt_candidates(lambda: batch.waiting_closed)
        try:
            self._pack_rt(batch, candidates, skip, cap)
        finally:
            candidates.close()  # puts back the waiting requests it pulled but did not admit

    def _pack_rt(self, batch: Batch, candidates: Iterator[Request], skip: AbstractSet[int], cap: int) -> None:
        # Locals and inline arithmetic: this loop runs for every RT request in the batch, twice.
        chunk_cost, iteration = self.cost_model.chunk_cost, self.cost_model.iteration
        gone, held = batch.gone, batch.held
        now, due, per_iteration = batch.now, self.queues.due, self.config.max_num_batched_tokens
        draft = batch.out is None
        whole = self.whole_prompts
        for request in candidates:
            if id(request) in skip or id(request) in gone:
                continue
            if len(held) >= cap:
                batch.size_bound = True  # constraint (7) binds: an RT request is left out
                return
            computed = request.num_computed_tokens
            lacking = len(request.token_ids) - computed
            num_new = lacking if lacking < batch.tokens_left else batch.tokens_left
            if num_new <= 0:
                break  # the token budget is spent
            if num_new < lacking and whole and lacking <= per_iteration:
                continue  # its whole prompt does not fit the token budget left: it cannot join
            if request.status is WAITING and not self._kv_within_reach(batch, request, computed + num_new):
                # Memory before risk: Alg. 1 adds RT requests "until ... no empty and preemptible
                # cache blocks exist"; one that no block could take joins no batch, so it puts
                # no one at risk. Passed over (or, with no_kv_waiting='close', it ends the
                # waiting requests' turn), in the draft as for real.
                if self.close_on_no_kv or not self.kv.can_place_rt_page():
                    batch.waiting_closed = True  # no waiting RT request can get a block this step
                continue
            # Eq. (6)'s residual: the time each iteration it still needs may take, for its next
            # token to be on time ("assuming the remaining tokens are scheduled consecutively").
            residual = (due[request] - now) / -(-lacking // per_iteration)
            cost = chunk_cost(computed, num_new)
            if residual < cost + iteration:
                # It misses its deadline even alone: served first, but no smaller batch saves it,
                # so it neither bounds the batch nor counts as SLO risk. So the first request
                # always fits, and a request that fits keeps the batch within its budget.
                residual = INF
            if batch.chunk_cost + cost + iteration > min(batch.budget, residual):
                if not batch.has_seat(request):
                    batch.seatless = True
                    continue  # it could not join the batch anyway, so it puts no one at risk
                batch.risk = batch.stop = True  # lines 11-12: it would push someone past a deadline
                break
            # The draft counts seats; for real, KV is found (evicting if need be) and reserved.
            if not (batch.has_seat(request) if draft else self._make_room_for_rt(batch, request, num_new)):
                batch.seatless = True
                if not draft and request.status is WAITING and not self.kv.can_place_rt_page():
                    batch.waiting_closed = True  # the RT chunks reserved before it took the last blocks
                continue  # no seat or no KV for it (FindPreemptBlock found nothing)
            batch.add(request, num_new, cost, residual)

    def _kv_within_reach(self, batch: Batch, request: Request, num_tokens: int) -> bool:
        """Whether the waiting RT `request` could hold `num_tokens` positions, allowing for the BE
        evictions `_make_room_for_rt` would make (running BE requests with no chunk this step);
        changes nothing, so the draft asks it too."""
        if self.can_chunk(request, num_tokens - request.num_computed_tokens):
            return True
        victims = (r for r in self.running if not is_rt(r) and not batch.holds(r) and not batch.evicted(r))
        return self.kv.fits_after_preempting(request, num_tokens, victims)

    def _select_be(self, batch: Batch, replace: bool, skip: AbstractSet[int] = frozenset()) -> None:
        """Alg. 1 lines 17-33 (past the requests in `skip`, which a replay already packed)."""
        candidates = self._be_candidates()
        try:
            self._pack_be(batch, candidates, replace, skip)
        finally:
            candidates.close()

    def _pack_be(self, batch: Batch, candidates: Iterator[Request], replace: bool,
                 skip: AbstractSet[int]) -> None:
        # Locals, and the whole chunk tried inline before any bisection: this loop runs for
        # every BE request in the batch, twice.
        gone, held, batch_size, draft = batch.gone, batch.held, self.batch_size, batch.out is None
        chunk_cost, iteration = self.cost_model.chunk_cost, self.cost_model.iteration
        whole, per_iteration = self.whole_prompts, self.config.max_num_batched_tokens
        for request in candidates:
            if batch.tokens_left <= 0:
                break
            if id(request) in gone or id(request) in skip:
                continue
            batch.unsettled |= batch.constrained  # a decision the real pass may take otherwise, not the last
            replaced = None
            if len(held) >= batch_size:
                batch.size_bound = True  # constraint (7) binds: a BE request replaces an RT one or waits
                replaced = self._replace_least_urgent_rt(batch) if replace else None
                if replaced is None:
                    break
            computed = request.num_computed_tokens
            lacking = len(request.token_ids) - computed
            num_new = min(lacking, batch.tokens_left)
            cost = chunk_cost(computed, num_new) if num_new > 0 else 0.0
            if num_new > 0 and batch.chunk_cost + cost + iteration > batch.budget:
                num_new, cost = batch.largest_chunk_within_budget(request)  # a BE prefill chunk shrinks to fit
            if whole and 0 < num_new < lacking <= per_iteration:
                num_new = 0  # its whole prompt does not fit the token or time budget left
            if num_new > 0 and (batch.has_seat(request) if draft else self._admit_be(batch, request, num_new)):
                batch.add(request, num_new, cost)
                batch.constrained = num_new < lacking
                continue
            batch.constrained = True
            if replaced is not None:
                batch.restore(replaced)  # the swap would not fit the time budget: undo it
                break

    def _replace_least_urgent_rt(self, batch: Batch) -> tuple[Request, int, float, float, int] | None:
        """Take out the least urgent RT request (never the most urgent) that can sit this
        iteration out: after it, each iteration it still needs may take as long as this one."""
        est, rt, now, due = batch.cost, batch.rt, batch.now, self.queues.due
        per_iteration = self.config.max_num_batched_tokens
        for at in range(len(rt) - 1, 0, -1):
            request = rt[at]
            deadline = due[request]
            lacking = len(request.token_ids) - request.num_computed_tokens
            iterations = max(1, -(-lacking // per_iteration))
            if deadline < INF and (deadline - now - est) / iterations >= est:
                return batch.remove(at)
        return None

    # -- replaying the draft -------------------------------------------------------------------
    # Exact where it runs: RT decisions carry over once no candidate lacked a seat (a replaced
    # RT request never shortened another's chunk: BE work needs token budget left), BE decisions
    # once all but the last granted a whole chunk (the real batch, with fewer RT requests, has
    # at least as much room), and the BE order held (no RT growth checkpointed a BE slot).
    def _replay_rt(self, batch: Batch, draft: Batch) -> bool:
        """The draft's RT requests, for real; False if the replay stopped short (or did not start)."""
        if draft.seatless:
            return False
        max_seqs = self.config.max_num_seqs
        for request, (num_new, cost, residual) in zip(draft.rt, draft.rt_chunks):
            seated = request.status is not WAITING or len(self.running) < max_seqs
            chunk = self.try_chunk(request, num_new) if seated else None
            if chunk is None:
                return False
            batch.add(request, num_new, cost, residual, chunk=chunk)
        batch.risk |= draft.rt_stop
        batch.stop = draft.rt_stop
        return True

    def _replay_be(self, batch: Batch, draft: Batch) -> bool:
        """The draft's BE requests, for real, if its decisions carry over; False where the
        replay stopped short (or did not start)."""
        if draft.unsettled:
            return False
        max_seqs = self.config.max_num_seqs
        for request, (num_new, cost) in zip(draft.be, draft.be_chunks):
            seated = request.status is not WAITING or len(self.running) < max_seqs
            chunk = self.try_chunk(request, num_new) if seated else None
            if chunk is None:
                return False
            batch.add(request, num_new, cost, chunk=chunk)
        return True

    def _adapt_batch_size(self, risk: bool) -> None:
        """§4.2: "At each iteration, if the scheduler does not trigger the early-return in lines
        11-12 of Alg. 1 ..., we increase the batch size"; "Once the estimated iteration time
        surpasses the residual time ..., we apply an aggressive penalty by resetting the current
        batch size back to" the initial one. The initial size and the increase are assumptions
        (class attributes): the paper's text lost both symbols."""
        if risk:
            self.batch_size = self._initial_size()
        else:
            grown = self.batch_size * self.batch_size_factor if self.batch_size_factor > 1 else \
                self.batch_size + self.batch_size_step
            self.batch_size = min(grown, self.config.max_num_seqs)

    # -- reserving KV: RT first, then BE -----------------------------------------------------
    def _admit_be(self, batch: Batch, request: Request, num_new: int) -> bool:
        """Whether `request` can have its chunk's KV (for real)."""
        if request.status == RequestStatus.WAITING:
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
        """BE requests first: those the draft did not serve, newest first, then those it did,
        newest first. Only a running RT request that cannot grow evicts RT requests: §5.2 lets RT
        preempt BE blocks alone, and admissions that evicted RT requests threw away half-done
        prefills in a loop under memory pressure. RT victims are only ever younger than the
        request: the oldest RT request can never be evicted, so RT requests cannot evict each
        other in a loop (urgency alone could). Among them the latest deadline goes first, the
        earliest in the queue on ties; unplanned first. A request that is held or gone never
        becomes a victim again within the step, so both orders are built once per batch and the
        BE one is walked with a cursor: in overload an RT request evicts one victim after
        another, and rescanning every running request for each was quadratic."""
        be, rt = batch.victims if batch.victims is not None else self._victim_orders(batch)
        held, gone = batch.held, batch.gone
        while batch.be_cursor < len(be) and (id(be[batch.be_cursor]) in gone or id(be[batch.be_cursor]) in held):
            batch.be_cursor += 1
        if batch.be_cursor < len(be):
            return be[batch.be_cursor]
        if request.status is WAITING:
            return None  # §5.2: an RT request is admitted onto free or BE blocks, never another RT's
        mine = self.queues.seniority(request)
        if not rt:
            return None
        assert batch.youngest_rt is not None  # the latest seniority in `rt`, set with it
        if mine >= batch.youngest_rt:  # the common case in overload: a newcomer
            return None
        return next((r for r, seniority in rt if seniority > mine and r is not request
                     and id(r) not in gone and id(r) not in held), None)

    def _victim_orders(self, batch: Batch) -> tuple[list[Request], list[tuple[Request, tuple]]]:
        assert batch.draft is not None  # only the real pass evicts, and it has its draft
        planned = batch.draft.holds
        be = [r for r in reversed(self.running) if not is_rt(r)]
        rt = [r for r in self.running if is_rt(r)]
        due = self.queues.due
        latest_first = sorted(rt, key=lambda r: -due[r])  # stable: queue order on ties
        rt_order = [(r, self.queues.seniority(r)) for r in latest_first if not planned(r)]
        rt_order += [(r, self.queues.seniority(r)) for r in latest_first if planned(r)]
        batch.youngest_rt = max((seniority for _, seniority in rt_order), default=None)
        batch.victims = ([r for r in be if not planned(r)] + [r for r in be if planned(r)], rt_order)
        return batch.victims

    def _evict(self, batch: Batch, victim: Request) -> None:
        self.running.remove(victim)
        assert batch.out is not None  # a draft reserves nothing: it never evicts
        self.preempt(victim)
        batch.out.preempted.append(victim)
        batch.gone.add(id(victim))
