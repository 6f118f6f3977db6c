"""What every scheduling policy shares: the queues, the batch it hands the executor, and the
bookkeeping after a step.

A policy decides, each step, which requests advance and by how many tokens, within one token
budget (`max_num_batched_tokens`) and one sequence cap (`max_num_seqs`). It sees requests and
memory managers, never the model. Its decision is a `SchedulerOutput`: an ordered list of
`ScheduledChunk`s, each "advance this request over positions [start, start + num_tokens)".
The executor (real model or simulator) runs the chunks; a chunk that brings its request level
with all its tokens also samples the request's next token.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from nanoserve.config import SchedulerConfig
from nanoserve.memory.blocks import BlockPool, NoFreeBlocksError
from nanoserve.memory.host import KVCopy
from nanoserve.memory.manager import KVManager, PagedKV
from nanoserve.request import Request, RequestStatus
from nanoserve.sched.cost_model import DEFAULT_COST_MODEL, Calibration, CostModel
from nanoserve.sched.output import ScheduledChunk, SchedulerOutput


class Scheduler(ABC):
    # The `SchedulerConfig.policy_options` this policy takes (name -> what it sets); none by default.
    OPTIONS: dict[str, str] = {}
    # Can this policy schedule while earlier steps are still in an asynchronous pipeline
    # (`SchedulerConfig.microbatches_in_flight` > 1)? Its `plan` must skip requests with a token
    # in flight (`schedulable`) and give a step at most `running_share` running requests; FCFS
    # (and KunServe, which reuses its pass) does. Policies with more state per request do not.
    ASYNC_PIPELINE: bool = False
    # Can this policy schedule a running request whose last token is still in flight, feeding
    # it from the device (`SchedulerConfig.async_scheduling`)? Its `plan` must ask
    # `tokens_lacking` and `schedulable`; FCFS does.
    ASYNC_SCHEDULING: bool = False
    # Can this policy ask to stop the forward in flight when a request arrives (ConServe Alg. 2's
    # PREEMPTRUNNING)? Such a policy answers `stops_running_batch_for`; the engine hands a yes to
    # the executor, and the server and the simulator admit arrivals at safe points.
    PREEMPTS_RUNNING_BATCH: bool = False

    def __init__(self, config: SchedulerConfig, kv: KVManager | BlockPool, cost_model: CostModel | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        unknown = set(config.policy_options) - set(self.OPTIONS)
        if unknown:
            raise ValueError(f"policy {config.policy!r} takes no option {', '.join(sorted(unknown))} "
                             f"(it takes: {', '.join(sorted(self.OPTIONS)) or 'none'})")
        self._check_in_flight(config)
        if config.async_scheduling and not self.ASYNC_SCHEDULING:
            raise ValueError(f"policy {config.policy!r} cannot schedule asynchronously (fcfs can)")
        self.kv = PagedKV(kv) if isinstance(kv, BlockPool) else kv
        # Policies that budget time (BROS, ConServe, KunServe, EcoServe) ask the cost model what a
        # batch would take and the clock what time it is; tests pass a mock clock.
        self.cost_model = cost_model if cost_model is not None else DEFAULT_COST_MODEL
        self.calibration: Calibration | None = None  # set by `calibrate`
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._copies: list[list[KVCopy]] = []  # this step's copy groups, in call order
        self._landed: tuple[int, ...] = ()  # landed tickets not yet sent to the executor

    # -- what a policy implements --------------------------------------------------------
    @abstractmethod
    def plan(self) -> SchedulerOutput:
        """Pick this step's chunks with `chunk` (which reserves their KV) and `preempt`."""

    def schedule(self) -> SchedulerOutput:
        started = time.perf_counter()  # wall time, whatever `self.clock` is: the host's own cost
        self._landed += self.kv.poll_copies()  # first: what landed may be reused by this step
        self._copies = []
        self._add_copies(self.kv.step_copies(self.running, self.copy_window()))
        out = self.plan()
        out.kv_copies = self._copies
        if not out.is_empty:  # an empty step reaches no executor: its tickets wait for the next
            out.landed_copies, self._landed = self._landed, ()
        out.plan_seconds = time.perf_counter() - started
        return out

    def counters(self) -> dict[str, int]:
        """Counts of the policy's own decisions (how often each branch ran), for the
        experiments' reports; the KV manager's are `KVManager.events`. None by default."""
        return {}

    def copy_window(self) -> float | None:
        """Seconds of link time this step's background KV copies may take (None: no limit).
        A policy with an SLO (ConServe) derives it from the SLO."""
        return None

    def settle(self) -> None:
        """Nothing is left to run: let the KV manager see its last copies land (waiting for the
        copy stream), so blocks held for them are free while the engine is idle."""
        self._landed += self.kv.poll_copies(wait=True)

    def _add_copies(self, copies: list[KVCopy]) -> None:
        if copies:
            self._copies.append(copies)

    def calibrate(self, predicted: float, measured: float) -> None:
        """The engine measured a step that `self.cost_model` priced at `predicted`: scale the
        model the policy budgets with by the running measured/predicted factor (`Calibration`)."""
        if self.calibration is None:
            self.calibration = Calibration(self.cost_model)
        self.cost_model = self.calibration.observe_scaled(predicted, measured)

    # -- shared bookkeeping --------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def stops_running_batch_for(self, request: Request) -> bool:
        """Called by the engine right after `add_request(request)`: should the forward in flight
        stop at its next safe point so that `request` starts sooner (ConServe Alg. 2's
        PREEMPTRUNNING)? Default: never (a policy without `PREEMPTS_RUNNING_BATCH`)."""
        return False

    def update_after_step(self, output: SchedulerOutput) -> None:
        """The executor has written K/V for every scheduled token: full blocks among them may
        be shared from now on (`KVManager.commit_computed`)."""
        commit = self.kv.commit_computed if self.kv.prefix_caching else None
        size = self.kv.block_size
        for chunk in output.chunks:
            chunk.request.num_computed_tokens = chunk.end
            # Only a chunk that fills a block has something to commit (most decodes do not); a
            # block whose last token was not known yet (asynchronous scheduling) is committed
            # with the next one the request fills.
            if commit is not None and chunk.end // size > chunk.start // size:
                commit(chunk.request)

    # -- an asynchronous pipeline (Engine's pipelined step) ------------------------------
    def update_after_submit(self, output: SchedulerOutput) -> None:
        """The step has entered the pipeline: count its tokens as computed now, as vLLM v1
        does. Every stage runs steps in the order they were submitted, so each layer's K/V is
        read and written in scheduling order, as if each step had finished before the next: the
        next step may run a prompt's following chunk, and may reuse blocks a preemption or
        abort freed. What it may not do is run a request whose sampled token is still on its
        way (`Request.num_pending_tokens`), unless the executor feeds that token from the
        device (`schedulable`)."""
        self.update_after_step(output)
        for chunk in output.chunks:
            if chunk.samples:
                chunk.request.num_pending_tokens += 1

    def update_after_landing(self, output: SchedulerOutput) -> None:
        """The step's sampled tokens are back (the engine appends them next), or will never
        come (the pipeline failed): either way none of them is pending any more."""
        for chunk in output.chunks:
            if chunk.samples:
                chunk.request.num_pending_tokens -= 1

    def tokens_lacking(self, request: Request) -> int:
        """Positions of `request` whose K/V is not computed: its known tokens' and, under
        asynchronous scheduling, the one a step in flight is sampling. For a waiting request
        that holds nothing, those past its cached prefix (`cached_prefix`)."""
        start = request.num_computed_tokens or self.cached_prefix(request)
        return request.num_tokens + request.num_pending_tokens - start

    # -- automatic prefix caching (memory/prefix_cache.py) ------------------------------------
    def cached_prefix(self, request: Request) -> int:
        """Leading tokens of a waiting `request` with nothing computed whose K/V the KV manager
        has cached (`KVManager.cached_prefix`): its chunk starts after them. 0 for any other.

        vLLM v1's scheduler looks the cache up when it first considers a waiting request
        (`get_computed_blocks`) and shares the blocks when it allocates the request's slots; so
        does `try_chunk` here, in one manager call. A policy that sizes a waiting request's chunk
        by `tokens_lacking` sizes it past the cached prefix; one that counts from
        `num_computed_tokens` asks for more than it gets (`try_chunk` trims the chunk)."""
        if request.num_computed_tokens or request.num_pending_tokens or request.status is not RequestStatus.WAITING:
            return 0
        if request.params.prompt_logprobs is not None:
            return 0  # its prompt's logits are wanted, so every token is computed (as in vLLM)
        return self.kv.cached_prefix(request)

    def schedulable(self, request: Request) -> bool:
        """May this step advance `request`? Always, unless a token of it is in flight. Then only
        under asynchronous scheduling (vLLM v1's, `SchedulerConfig.async_scheduling`), where the
        executor reads the missing input from the device: the request's next position is
        computed before its last token is known on the host. Not if that token may be its last
        by `max_tokens` or the context limit: the next one would be thrown away. A stop token
        or string cannot be foreseen: a request it ends has computed one position too many,
        and the engine drops that token. A waiting request (preempted with a token in flight)
        recomputes from its known tokens, so it waits for the token to land."""
        pending = request.num_pending_tokens
        if not pending:
            return True
        return (self.config.async_scheduling
                and request.num_output_tokens + pending < request.params.max_tokens
                and request.num_tokens + pending < self.config.max_model_len)

    def running_share(self) -> int:
        """How many running requests one step may advance: all of them, or under an
        asynchronous pipeline of d micro-batches in flight, ⌈running / d⌉, so that the d steps in
        flight each carry a share of the decodes (vLLM's virtual engines give each of the S
        pipeline engines 1/S of the requests for the same reason; ours rebalance every step
        instead of pinning a request to an engine). Without the cap one step would take every
        decode and the next would find none ready: the pipeline would run one step at a time."""
        depth = self.config.microbatches_in_flight
        return len(self.running) if depth == 1 else -(-len(self.running) // depth)

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Take a request out of the queues for good and release its KV."""
        assert status.finished
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        self.kv.release(request)

    def preempt(self, request: Request, keep_resident: bool = False) -> bool:
        """Take the request's KV off the device and put it at the head of the queue. It keeps
        its tokens; it resumes from whatever K/V the memory manager saved (often none:
        recompute). With `keep_resident` the manager only pauses it (`KVManager.pause`): where it
        can, the K/V stays on the device until the policy needs the memory. True if it did."""
        preempted = self.kv.pause(request) if keep_resident else self.kv.preempt(request)
        kept, copies = (request.num_computed_tokens, []) if preempted is None else preempted
        self._add_copies(copies)
        request.num_computed_tokens = kept
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        return preempted is None

    def admit(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def detach(self, request: Request) -> None:
        """Take a request out of the queues and release its KV without finishing it: it moves
        to another engine (Llumnix's migration). Policies that keep more per-request state
        than the two queues do not support it."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.release(request)

    # -- KunServe's cluster and Llumnix's migration move requests and memory under a policy ---
    def use_kv_manager(self, kv: KVManager) -> None:
        """Take K/V from `kv` from now on (a cluster member's blocks are re-carved when its
        layout changes: a pool of its own, or its share of a pipeline group's). The running
        requests' blocks must already be reserved in `kv`."""
        self.kv = kv

    def limit_sequences(self, max_num_seqs: int) -> None:
        """Run at most `max_num_seqs` sequences from now on (a KunServe member whose pool a drop
        enlarged or a restore gave back: the cap follows the KV, as the config's did for the
        replica). Running requests over a lowered cap finish; no new one starts until under it."""
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, not {max_num_seqs}")
        self.config = replace(self.config, max_num_seqs=max_num_seqs)

    def keep_in_flight(self, steps: int) -> None:
        """Plan for `steps` steps in flight from now on (a KunServe member whose group keeps its
        steps in flight, or 1 alone again): each step then takes a 1/steps share of the running
        requests, and none whose token is still in flight (`running_share`, `schedulable`)."""
        config = replace(self.config, microbatches_in_flight=steps)  # SchedulerConfig refuses steps < 1
        self._check_in_flight(config)
        self.config = config

    def _check_in_flight(self, config: SchedulerConfig) -> None:
        if config.microbatches_in_flight > 1 and not self.ASYNC_PIPELINE:
            raise ValueError(f"policy {config.policy!r} cannot schedule for an asynchronous pipeline "
                             f"(fcfs and kunserve can)")

    def use_pipeline(self, num_stages: int, microbatches_per_step: int, step_tokens: int | None = None) -> None:
        """The executor under this policy became a pipeline of `num_stages` stages (a cluster
        member joined a group, or left one: 1), running `microbatches_per_step` micro-batches a
        step, `step_tokens` tokens at most across them (None: the token budget; the executor's
        activations must hold each micro-batch). Default: nothing, a policy that does not cut
        micro-batches itself."""

    def stall(self, request: Request) -> None:
        """Take a running request out of the batch, keeping its K/V: it waits for its K/V to
        arrive (KunServe's exchange, §4.2) or to leave (a migration's last stage), and runs
        again after `resume`, or leaves with `detach`."""
        self.running.remove(request)

    def resume(self, request: Request) -> None:
        """A stalled request runs again, its K/V in place."""
        self.running.append(request)

    def requeue_running(self) -> int:
        """Preempt every running request, in order, to recompute (KunServe §4.4: a member whose
        pipeline peer died lost their K/V of the peer's layers). Returns how many."""
        running = list(self.running)
        self.running.clear()
        for request in reversed(running):  # `preempt` puts each at the head: keep their order
            self.preempt(request)
        return len(running)

    def attach(self, request: Request) -> None:
        """Run a request another engine detached, whose K/V this manager already holds."""
        if len(self.kv.block_table(request)) * self.kv.block_size < request.num_computed_tokens:
            raise ValueError(f"{request.request_id}: its K/V is not reserved here")
        self.admit(request)

    def can_chunk(self, request: Request, num_tokens: int) -> bool:
        """Could `num_tokens` more tokens of `request` get KV slots now (past its cached prefix,
        for a waiting request: `cached_prefix`)?"""
        hit = self.cached_prefix(request)
        if not hit:
            return self.kv.can_reserve(request, request.num_computed_tokens + num_tokens)
        request.num_computed_tokens = hit  # as `try_chunk` would set it; undone below
        try:
            return self.kv.can_reserve_cached(request, hit + self._trim(request, num_tokens), hit)
        finally:
            request.num_computed_tokens = 0

    def try_chunk(self, request: Request, num_tokens: int) -> ScheduledChunk | None:
        """`chunk` if the KV slots are there (one manager call instead of `can_chunk` then
        `chunk`), else None, changing nothing."""
        hit = self.cached_prefix(request)
        if hit:
            request.num_computed_tokens = hit  # the cached blocks count as computed
            num_tokens = self._trim(request, num_tokens)
            copies = self.kv.try_reserve_cached(request, hit + num_tokens, hit)
        else:
            copies = self.kv.try_reserve(request, request.num_computed_tokens + num_tokens)
        if copies is None:
            request.num_computed_tokens -= hit
            return None
        self._admitted_with(request, hit)
        self._add_copies(copies)
        return ScheduledChunk(request, request.num_computed_tokens, num_tokens, self.kv.block_table(request),
                              self.kv.right_to_left(request))

    def chunk(self, request: Request, num_tokens: int) -> ScheduledChunk:
        """Reserve KV slots for `num_tokens` more tokens of `request` and describe the chunk.
        Raises NoFreeBlocksError, changing nothing, if they are not there."""
        if self.cached_prefix(request):
            chunk = self.try_chunk(request, num_tokens)
            if chunk is None:
                raise NoFreeBlocksError(f"{request.request_id}: no room for {num_tokens} tokens past its cached prefix")
            return chunk
        start = request.num_computed_tokens
        self._add_copies(self.kv.reserve(request, start + num_tokens))
        self._admitted_with(request, 0)
        return ScheduledChunk(request, start, num_tokens, self.kv.block_table(request),
                              self.kv.right_to_left(request))

    def _trim(self, request: Request, num_tokens: int) -> int:
        """A chunk a policy sized from the request's first token, cut to what its cached prefix
        leaves (a policy that sized it by `tokens_lacking` asked for no more than that)."""
        return min(num_tokens, request.num_tokens + request.num_pending_tokens - request.num_computed_tokens)

    @staticmethod
    def _admitted_with(request: Request, hit: int) -> None:
        """Record the prompt tokens a request found cached when it first got K/V (OpenAI's
        `cached_tokens`); a later resume after a preemption does not change it."""
        if request.num_cached_tokens is None:
            request.num_cached_tokens = min(hit, request.num_prompt_tokens)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)
