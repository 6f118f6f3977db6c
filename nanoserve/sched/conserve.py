"""ConServe: online and offline requests co-served under the online SLO (conserve.txt §4.2-4.5).

The passes, victims and queues are vLLM++'s (`sched/priority.py`, which ConServe extends with
`_allowance`, `_after_running` and `_schedule`). Each step (`plan`, Algorithm 1's
UNIFIEDSCHEDULE) serves, in this order:
1. running online requests, then waiting online ones (preempting running offline requests,
   newest first, when one needs KV room): online work always goes first;
2. running offline requests, then waiting offline ones, each only as far as the step's budget
   allows: the budget is the largest batch whose iteration time, as the cost model predicts it,
   meets the online target (`iteration_target`, §4.5's SLO-aware policy: the online TPOT when an
   online request is decoding, else its TTFT). Offline chunks shrink to fit (chunked prefill);
3. running offline requests left over the budget are paused, newest first
   (PREEMPTOVERBUDGETOFFLINE, Alg. 1 lines 16 and 26-34): over the checkpointing KV manager
   (`nanoserve/memory/checkpoint_kv.py`, §4.4) "checkpointing keeps KV caches in GPU memory until
   incoming online requests are scheduled", so a paused request keeps its blocks and resumes with
   no copy. Its blocks are dropped only when a request needs the memory (`_make_room`: an online
   request; ours, also a running one that cannot grow or an older parked one resuming), before
   any running request is preempted: the paused request with the least to recompute (its
   checkpoint current: nothing) first, then the newest; never to admit new offline work. When
   running requests must go after all, ConServe "can selectively preempt offline requests that
   have been checkpointed" (§4.4): offline victims are again chosen by least to recompute, then
   newest;
4. with no online request anywhere, the offline batching mode (Alg. 1 lines 20-22): no time
   budget, and nothing is preempted for being over it. §4.2: "the scheduler ignores the budget
   limit and sets the largest batch size that can saturate GPU compute or memory capacity";
   §4.3: "in offline batching mode, ConServe aggressively increases batch sizes and chunk sizes
   and relies on layer-wise preemption to maintain responsiveness". So the step's token budget
   is `offline_batch_tokens` (policy option); None is Alg. 1 line 21's Inf: the batch is
   bounded by the KV memory and `max_num_seqs` alone, and a prompt's chunk is its whole rest.
   The default is `max_num_batched_tokens` (ours): a real engine sizes its step buffers, graphs
   and the scheduling contract to it, so only the simulator's experiments lift it.
   assumption: "largest batch size that can saturate GPU compute or memory capacity" read as
   "as large as memory allows" (Alg. 1 passes Inf); the option bounds it where a deployment
   must (activation memory, which the simulator does not model). `offline_batch_tokens=2048`
   is the rule before issue 45 (the engine's `max_num_batched_tokens`), kept as an ablation.

An online request is never cut by the TTFT target (finishing its prompt sooner is what meets
TTFT); while online requests decode, an online prompt's chunk is held to the TPOT target, but
to at least `MIN_ONLINE_CHUNK` tokens, so an unattainable target cannot starve it.

Arrival (`add_request`, Algorithm 2's ONRECVONLINEREQUEST): if the batch in flight is pure
offline and waiting for it would make the new online request miss its TTFT (the rest of the
batch's predicted time plus the predicted time of the online queue with the batch's work), the
policy says so (`stops_running_batch_for`); the engine hands that to the executor, whose forward stops
at its next safe point, every k layers (`ModelRunner.request_preemption`, `PreemptionFlag`:
§4.3's layer-wise preemption, only in pure-offline batches). The engine discards the stopped
step (no request advances) and the next `plan` serves the online request first. §4.3: workers
"immediately abort the remaining execution and return an empty result", and the scheduler
"cleans up the partial computation states, restores its own state, and quickly schedules any
incoming online requests": the whole forward stops, whatever Alg. 2's victim set. Its victims
are then the offline requests the next `plan` leaves over that step's budget (paused, as above);
the rest run beside the online request. Nothing is lost: stopped requests keep their KV. The
scheduler never touches the model: it only raises the flag. Arrivals reach `add_request` mid-forward in the server: its
engine loop (`nanoserve/async_engine.py`) takes them in at the runner's safe points
(`PreemptionFlag.on_safe_point`); `LLM.generate` adds all requests up front, so offline
`generate` calls never need it.

Prefetch (§4.4, "background prefetching"): a preempted offline request whose checkpoint is on
the host is not resumed by loading it in the step that runs it. At the head of the queue it is
set aside (`_defer`): the manager allocates its blocks and loads them over the following steps
as the link budget allows, while the requests behind it are admitted ("launches a new offline
batch and runs for its prefill phase, and meanwhile prefetches"); it is admitted once every
load is issued. The link budget is §4.5's "uses the SLO to decide the maximum number of KV cache
blocks that can be swapped in the background" (`copy_window`); the checkpoint saves are the
manager's `step_copies` (called by the base scheduler every step) and spend it first. A load
that must still block a step (a resumed online request's) is priced in that step's budget.

The budget "limits both the number of tokens and the number of requests in a batch" (§4.2): the
cost model prices every request (a decode's ε, a prefill chunk's γ) beside every token, so the
time budget caps both, under `max_num_batched_tokens` and `max_num_seqs`.
"""
from __future__ import annotations

import sys
from collections import Counter
from typing import Any, Literal

from nanoserve.request import Request, RequestStatus
from nanoserve.sched.output import ScheduledChunk, SchedulerOutput
from nanoserve.sched.priority import PriorityScheduler
from nanoserve.slo import RequestClass


class ConServeScheduler(PriorityScheduler):
    """vLLM++'s passes and victims (sched/priority.py) with ConServe's time budget on offline
    work, its over-budget preemption, and Algorithm 2."""

    MIN_ONLINE_CHUNK = 16  # tokens an online prompt chunk always gets, whatever the TPOT target
    PREEMPTS_RUNNING_BATCH = True  # Alg. 2 (Scheduler.PREEMPTS_RUNNING_BATCH)
    OPTIONS = {
        "offline_batch_tokens": "token budget of a step in the offline batching mode (Alg. 1 lines 20-22; "
                                "default: max_num_batched_tokens, what a real engine's buffers hold; null: "
                                "Inf, bounded by KV memory and max_num_seqs, as the simulated experiments run it)",
        "prefetch": "§4.4's background prefetching (default True); False: a checkpointed request is loaded in "
                    "the step that resumes it, which waits for the loads (Fig. 8's '+ checkpointing' bar)",
    }

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        options = self.config.policy_options
        # Absent: the engine's max_num_batched_tokens, the step size its buffers (and the
        # scheduling contract) are built for; None (the simulator's experiments): no token budget.
        self.offline_batch_tokens: int | None = options.get("offline_batch_tokens",
                                                             self.config.max_num_batched_tokens)
        if self.offline_batch_tokens is not None and self.offline_batch_tokens < 1:
            raise ValueError(f"offline_batch_tokens must be positive, got {self.offline_batch_tokens}")
        self.prefetch: bool = bool(options.get("prefetch", True))
        # Counters (`counters`): steps planned in the offline batching mode, those of them that
        # took more tokens than `max_num_batched_tokens` (where the mode's budget matters), and
        # offline admissions stopped because a resumed request's in-step loads did not fit the
        # step's time target (without prefetch, the loads are in the step).
        self.num_offline_batching_steps = self.num_offline_batching_big_steps = 0
        self.num_restore_blocked = 0
        self._offline_mode = False
        self.num_running_batch_preemptions = 0  # Alg. 2's requests to stop the batch in flight
        self._in_flight: tuple[SchedulerOutput, float] | None = None  # (batch, t_sched)
        # The targets of the online requests, by the phase each is in (its TTFT before its first
        # token, its TPOT after), so the tightest is read without scanning 10,000 requests.
        self._phase: dict[str, tuple[str, float]] = {}
        self._targets: dict[str, Counter[float]] = {"ttft": Counter(), "tpot": Counter()}
        # Waiting requests that hold device KV (paused, or prefetched ahead): an online request
        # takes their memory before anyone else's.
        self._parked: dict[str, Request] = {}
        self._last_forward = 0.0  # the previous step's predicted seconds
        self.num_parked_dropped = 0

    # -- Algorithm 1: UNIFIEDSCHEDULE -------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = super().schedule()
        self._in_flight = (out, self.clock()) if out.chunks else None  # t_sched
        self._last_forward = self.cost_model.predict_output(out)
        return out

    def copy_window(self) -> float | None:
        """Seconds of link time the step's background copies (checkpoint saves, then prefetch
        loads) may take: §4.5 "uses the SLO to decide the maximum number of KV cache blocks that
        can be swapped in the background, and defers the extra blocks to the next round".

        assumption: copies stay in the background while they fit under the forward they overlap,
        so the window is the step's SLO target, or the previous step's predicted time when that
        is shorter (the paper names no formula); in the offline batching mode, the previous
        step's predicted time, and no limit after an idle step (nothing to overlap, nothing
        waits)."""
        _, target = self.iteration_target()
        last = self._last_forward
        if target is None:
            return last or None
        return min(target, last) if last > 0 else target

    def update_after_step(self, output: SchedulerOutput) -> None:
        super().update_after_step(output)
        self._in_flight = None
        for chunk in output.chunks:  # the engine appends the sampled token right after this
            if chunk.samples and chunk.request.num_output_tokens == 0:
                self._track(chunk.request, "tpot")

    def plan(self) -> SchedulerOutput:
        self._seconds = 0.0  # predicted time of this step's chunks, without the per-step constant
        self._tpot_target, self._target = self.iteration_target()
        out = super().plan()
        if self._offline_mode and sum(c.num_tokens for c in out.chunks) > self.config.max_num_batched_tokens:
            self.num_offline_batching_big_steps += 1
        return out

    def counters(self) -> dict[str, int]:
        return {"running_batch_preemptions": self.num_running_batch_preemptions,
                "offline_batching_steps": self.num_offline_batching_steps,
                "offline_batching_big_steps": self.num_offline_batching_big_steps,
                "parked_dropped": self.num_parked_dropped, "restore_blocked": self.num_restore_blocked}

    def _start_step(self) -> None:
        """The offline batching mode's budget (Alg. 1 line 21: SLOAWARESCHEDULE(Q_off, Inf)):
        with no online request anywhere, the step's token budget is `offline_batch_tokens`
        (None: no token budget at all; KV memory and `max_num_seqs` bound the batch)."""
        super()._start_step()
        self._offline_mode = self.offline_batching_mode()
        if self._offline_mode:
            self.num_offline_batching_steps += 1
            # sys.maxsize, not math.inf: the budget is an int the passes subtract chunks from.
            self._budget = self.offline_batch_tokens if self.offline_batch_tokens is not None else sys.maxsize

    def offline_batching_mode(self) -> bool:
        """No online request waiting or running (§4.2: "a model may not receive any new online
        requests"). Both queues are online-first once the step has started."""
        return not ((self.waiting and self.waiting[0].priority is RequestClass.ONLINE)
                    or (self.running and self.running[0].priority is RequestClass.ONLINE))

    def iteration_target(self) -> tuple[float | None, float | None]:
        """(the TPOT target of decoding online requests, the step's time target), in seconds.

        §4.5: "the latency SLO (TPOT for batches containing decode phase requests, TTFT
        otherwise)", the tightest over the online requests; (None, None) in the offline batching
        mode, or when no online request has a target."""
        tpot = min(self._targets["tpot"], default=None)
        return tpot, tpot if tpot is not None else min(self._targets["ttft"], default=None)

    def _allowance(self, request: Request) -> int:
        """What it lacks, within the token budget and, for offline requests, within the step's
        time target (SLOAWARESCHEDULE)."""
        want = super()._allowance(request)
        if want <= 0:
            return 0
        if request.priority is RequestClass.ONLINE:
            if want == 1 or self._tpot_target is None:
                return want
            return max(self._fit(request.num_computed_tokens, want, self._tpot_target),
                       min(want, self.MIN_ONLINE_CHUNK))
        if self._target is None:
            return want
        restore = self.kv.restore_seconds(request)
        fit = self._fit(request.num_computed_tokens, want, self._target, restore)
        self.num_restore_blocked += fit == 0 and restore > 0
        return fit

    def _fit(self, prefix: int, want: int, target: float, extra: float = 0.0) -> int:
        """The largest chunk (at most `want` tokens over `prefix`) that keeps the step's predicted
        time, plus `extra` seconds (loads the step must wait for), within `target`; 0 if none
        does. The cost model's chunk cost grows with its size."""
        base = self.cost_model.iteration + self._seconds + extra

        def fits(n: int) -> bool:
            return base + self.cost_model.chunk_cost(prefix, n) <= target

        if fits(want):
            return want
        lo, hi = 0, want  # fits(lo) or lo == 0; not fits(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    def _after_running(self, cls: RequestClass, out: SchedulerOutput) -> None:
        """PREEMPTOVERBUDGETOFFLINE (Alg. 1 lines 16, 26-34): running offline requests the
        budget left out, newest first, are preempted; "checkpointing keeps KV caches in GPU
        memory until incoming online requests are scheduled" (§4.4), so each is paused with its
        blocks (`KVManager.pause`) and `_make_room` drops them only for a request that needs the
        memory."""
        if cls is not RequestClass.OFFLINE or self._target is None:
            return
        for request in reversed([r for r in self.running if r.priority is RequestClass.OFFLINE]):
            if request.request_id not in self._served:
                if self._evict(request, out, keep_resident=True):
                    self._parked[request.request_id] = request

    def _make_room(self, request: Request, num_new: int, out: SchedulerOutput, online_victims: bool) -> bool:
        """Before preempting anyone running, an online request takes the device memory of
        parked requests (paused, or prefetched ahead): least to recompute first, then newest.

        assumption (ours): so do a running offline request that cannot grow (its alternative is
        preempting a running request, never cheaper than dropping a parked one) and a parked
        request resuming at the head of the queue (it is older than those behind it; without
        this, parked requests holding all the memory would wait for each other). The issue's
        stricter reading, online requests only, made running offline requests preempt
        themselves while paused ones held the memory (8% of preempted tokens kept, ci scale).
        Admitting new offline work never drops a parked request."""
        parked = request.request_id in self._parked
        if request.priority is RequestClass.ONLINE or request.status == RequestStatus.RUNNING or parked:
            while not self.can_chunk(request, num_new):
                others = [r for r in reversed(self._parked.values()) if r is not request]
                if not others:
                    break
                self._drop_parked(min(others, key=self.kv.preemption_loss), out)
        if parked:  # a parked request never preempts running work
            return self.can_chunk(request, num_new)
        return super()._make_room(request, num_new, out, online_victims)

    def _may_make_room(self, request: Request) -> bool:
        return super()._may_make_room(request) or request.request_id in self._parked

    def _drop_parked(self, request: Request, out: SchedulerOutput) -> None:
        """Drop a parked request's device KV. It stays where it is in the queue, keeping what its
        checkpoint holds, and is not taken back in this step."""
        del self._parked[request.request_id]
        kept, copies = self.kv.preempt(request)
        self._add_copies(copies)
        request.num_computed_tokens = kept
        out.preempted.append(request)
        self._preempted.add(request.request_id)
        self.num_parked_dropped += 1

    def _give_up(self, request: Request, out: SchedulerOutput) -> None:
        """An offline request that cannot grow is paused, not dropped: its K/V stays until
        someone needs the memory (§4.4)."""
        if request.priority is not RequestClass.OFFLINE:
            return super()._give_up(request, out)
        if self._evict(request, out, keep_resident=True):
            self._parked[request.request_id] = request

    def _victim(self, request: Request, cls: RequestClass) -> Request | None:
        """§4.4: ConServe "can selectively preempt offline requests that have been
        checkpointed": an offline victim is the one with least to recompute, then the newest."""
        if cls is not RequestClass.OFFLINE:
            return super()._victim(request, cls)
        return min(self._unserved(request, cls), key=self.kv.preemption_loss, default=None)

    def _defer(self, request: Request, out: SchedulerOutput) -> Literal["admit", "defer", "stop"]:
        """§4.4 background prefetching: a preempted offline request whose checkpoint is still
        to be loaded is set aside while its loads go out (split over steps, within the link
        budget), and the requests behind it are admitted meanwhile ("launches a new offline batch
        and runs for its prefill phase, and meanwhile prefetches").

        A prefetch that cannot start (no room for the checkpoint yet, or its saves still in
        flight) stops offline admission for the step, as any request at the head of the queue
        would: new work admitted past it would take the memory it waits for and, once paused or
        preempted in turn, the host memory too (ours: measured, letting new work pass starved
        preempted requests until the host store filled and checkpoints stopped).

        With the `prefetch` option off (Fig. 8's "+ incremental checkpointing" bar, §6.4.1),
        every request is admitted in queue order and loads its checkpoint in the step that
        resumes it, which waits for the loads (Fig. 4(c), without 4(d)'s background swap-in)."""
        if (not self.prefetch or request.priority is not RequestClass.OFFLINE
                or self.kv.blocks_to_restore(request) == 0):
            return "admit"
        copies = self.kv.prefetch(request)
        if copies is not None:
            self._add_copies(copies)
            self._parked[request.request_id] = request
            return "defer"
        return "defer" if request.request_id in self._parked else "stop"  # started: the link budget ran out

    def admit(self, request: Request) -> None:
        self._parked.pop(request.request_id, None)
        super().admit(request)

    def try_chunk(self, request: Request, num_tokens: int) -> ScheduledChunk | None:
        restore = self.kv.restore_seconds(request)  # loads the step would wait for
        chunk = super().try_chunk(request, num_tokens)
        if chunk is not None:
            self._seconds += restore
        return chunk

    def chunk(self, request: Request, num_tokens: int) -> ScheduledChunk:
        restore = self.kv.restore_seconds(request)
        chunk = super().chunk(request, num_tokens)
        self._seconds += restore
        return chunk

    def _schedule(self, request: Request, chunk: ScheduledChunk, out: SchedulerOutput) -> None:
        self._seconds += self.cost_model.chunk_cost(chunk.start, chunk.num_tokens)
        super()._schedule(request, chunk, out)

    # -- the online targets, by phase --------------------------------------------------------
    def _track(self, request: Request, phase: str | None) -> None:
        """Move `request`'s target to `phase` ("ttft", "tpot", or None: untracked)."""
        old = self._phase.pop(request.request_id, None)
        if old is not None:
            counter = self._targets[old[0]]
            counter[old[1]] -= 1
            if not counter[old[1]]:
                del counter[old[1]]
        target = None if phase is None or request.priority is not RequestClass.ONLINE else getattr(request.slo, phase)
        if target is not None:
            assert phase is not None  # a target is read only for a phase
            self._phase[request.request_id] = (phase, target)
            self._targets[phase][target] += 1

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        self._parked.pop(request.request_id, None)
        super().finish_request(request, status)
        self._track(request, None)

    # -- Algorithm 2: ONRECVONLINEREQUEST --------------------------------------------------
    def add_request(self, request: Request) -> None:
        super().add_request(request)
        self._track(request, "tpot" if request.num_output_tokens else "ttft")

    def stops_running_batch_for(self, request: Request) -> bool:
        """Alg. 2, lines 4-11: an online arrival that would miss its TTFT behind the pure-offline
        batch in flight asks for that batch to stop (PREEMPTRUNNING); the engine forwards it to
        the executor, which stops at its next safe point."""
        if request.priority is RequestClass.ONLINE and self.should_preempt_running_batch(request):
            self.num_running_batch_preemptions += 1
            return True
        return False

    def should_preempt_running_batch(self, request: Request) -> bool:
        """Would `request` miss its TTFT waiting for the pure-offline batch in flight?

        t_remain = predicted time of the batch B in flight - time it has run; t_exec = predicted
        time of the next step with the online queue and B's work (Alg. 2 lines 6-10). Preempt if
        t_remain + t_exec exceeds what is left of the TTFT target."""
        if self._in_flight is None or request.slo.ttft is None:
            return False
        batch, t_sched = self._in_flight
        if any(c.request.priority is RequestClass.ONLINE for c in batch.chunks):
            return False  # co-serving mode: the budget already bounds the step (§4.3)
        now = self.clock()
        t_remain = max(0.0, self.cost_model.predict_output(batch) - (now - t_sched))
        online = [(r.num_computed_tokens, min(r.num_tokens - r.num_computed_tokens, self.config.max_num_batched_tokens))
                  for r in self.waiting if r.priority is RequestClass.ONLINE]
        t_exec = self.cost_model.predict(online + [(c.start, c.num_tokens) for c in batch.chunks])
        return t_remain + t_exec > request.arrival_time + request.slo.ttft - now
