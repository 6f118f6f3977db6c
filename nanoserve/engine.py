"""The engine loop: schedule → execute → postprocess, one step at a time.

    add_request ─► Scheduler.waiting
    step():  batch = scheduler.schedule()        which requests advance, by how many tokens
             result = executor.execute(batch)    real model (ModelRunner) or simulator
             postprocess(batch, result)          append tokens, stop, free KV: EngineCoreOutputs
             outputs.process(core outputs)       detokenize, stop strings: RequestOutputs

`step` does all of it; `step_core` stops before the last line, for a caller that makes the
outputs on a thread of its own (output_processor.py says why, and how stop strings come back).

The engine is single-threaded. The server drives it from one background thread
(`async_engine.py`); `LLM.generate` drives it in a plain loop.

With an asynchronous pipeline (`pipeline`, under pipeline parallelism with `async_pipeline`)
a step is one micro-batch, and the engine keeps `depth` of them in flight, as vLLM v1's batch
queue does: while the later stages run micro-batch k, rank 0 schedules and starts k+1 instead
of waiting for k to drain. A synchronous pipelined step fills and drains the pipeline every
time, which idles (S − 1) / (m + S − 1) of its stage-time (KunServe's Fig. 8 bubbles come on
top of that); in flight, the next step's micro-batches fill what the last one's drain leaves.

    submit  ┌───┐┌───┐                    stage 0   [k  ][k+1][k+2][k+3]
            │k+1││ k │ ─► stages ─►          stage 1        [k  ][k+1][k+2]
            └───┘└───┘    collect k ─► postprocess, schedule k+2, submit it

A KunServe group with steps in flight (cluster/group.py) is a *clocked* pipeline: its stages
move on only when every member submits, so the engine submits a step every time (an empty one
when its policy has nothing to run) and collects once `depth` are in flight; `drain` lands them
all before the group changes.

Asynchronous scheduling (`SchedulerConfig.async_scheduling`, vLLM v1's) is the same loop over
one device, two steps deep: the host schedules, prepares and launches step n+1, then waits for
step n's tokens and post-processes them, all while the device runs step n+1. A request decoding
in step n is in step n+1 too: its input there is the token step n samples, which the runner
reads on the device (`ModelRunner.submit`), so the host never waits for it before launching.

    host    [sched+launch n+1][wait n][post n][sched+launch n+2][wait n+1][post n+1] ...
    device  [       step n          ][        step n+1          ][       step n+2 ...
"""
from __future__ import annotations

import itertools
import logging
import os
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any, NamedTuple

from nanoserve.config import SchedulerConfig
from nanoserve.engine_stats import EngineStats
from nanoserve.executor import Executor, ExecutorOutput, MicrobatchPipeline
from nanoserve.grammar import CompiledGrammar, GrammarBackend, GrammarCompiler, make_backend
from nanoserve.memory.manager import KVManager
from nanoserve.output_processor import OutputProcessor, RequestText
from nanoserve.outputs import EngineCoreOutput, RequestMetrics, RequestOutput, StringStop
from nanoserve.request import Request, RequestStatus
from nanoserve.sampling import SamplingParams
from nanoserve.sched.base import Scheduler
from nanoserve.sched.output import SchedulerOutput
from nanoserve.serving import ServingEngine
from nanoserve.slo import PRIORITIES, SLO, ClassMetrics, RequestClass
from nanoserve.tokenizer import Tokenizer

log = logging.getLogger("nanoserve.engine")


class Handover(NamedTuple):
    """A request between two engines (`Engine.detach_request` -> `attach_request`)."""
    request: Request
    text: RequestText | None  # its output so far (detokenizer, text streamed)


class _StoppedExecutor(Executor):
    """The executor of an engine after `shutdown`: it has no model to run."""

    def execute(self, batch: SchedulerOutput) -> ExecutorOutput:
        raise RuntimeError("the engine was shut down")


STOPPED = _StoppedExecutor()


class Engine(ServingEngine):
    """One model replica (or one tensor/pipeline-parallel group) and its scheduler: the
    `ServingEngine` (serving.py) a server drives; `tokenize` and `validate` come from there."""

    def __init__(self, scheduler: Scheduler, executor: Executor, tokenizer: Tokenizer | None,
                 eos_token_ids: frozenset[int] = frozenset(), model_name: str = "model",
                 calibrate_cost_model: bool = False, stream_outputs: bool = True,
                 pipeline: MicrobatchPipeline | None = None, sampling_defaults: Mapping[str, Any] | None = None,
                 vocab_size: int | None = None, reasoning_parser: str | None = None,
                 structured_outputs_backend: str = "llguidance"):
        """`calibrate_cost_model`: scale the policy's cost model by how long steps really take
        (`sched.cost_model.Calibration`); for a real executor, not a mock one. Without
        `stream_outputs`, `step` returns only the requests that finished (the simulator's
        choice: an output per token is a third of a simulated step's cost), and a request
        without stop strings makes a core output only when it finishes. `pipeline`: run
        steps through it asynchronously (see the module docstring); the scheduler must be
        configured with `steps_in_flight` equal to its depth. Asynchronous scheduling is such a
        pipeline of depth 2 over one device (`ModelRunner.submit`). `sampling_defaults`: the
        model's recommended sampling (generation_config.py), for callers building parameters.
        `vocab_size`: the model's logits width (structured outputs' bitmasks cover it; None: the
        tokenizer's); `reasoning_parser`: the model's reasoning format (a structured output starts
        after `</think>`); `structured_outputs_backend`: nanoserve.grammar.BACKENDS' name."""
        self.model_name = model_name
        # What a request's unset sampling fields default to (generation_config.py); read-only.
        self.sampling_defaults: Mapping[str, Any] = dict(sampling_defaults or {})
        self.reasoning_parser = reasoning_parser
        self.vocab_size = vocab_size
        self.structured_outputs_backend = structured_outputs_backend
        # Structured outputs (nanoserve/grammar/): grammars compile on a worker thread, off the
        # step; a request waits here, outside the scheduler, until its grammar is ready (vLLM's
        # WAITING_FOR_FSM), and others run meanwhile. `_constrained`: live requests whose next
        # draw reads their latest token on the host (a grammar; a bad word of several tokens).
        self._grammar_backend: GrammarBackend | None = None
        self._grammar_compiler: GrammarCompiler | None = None
        self._awaiting_grammar: dict[str, tuple[Request, Future[CompiledGrammar]]] = {}
        self._constrained: set[str] = set()
        self.stream_outputs = stream_outputs
        self.calibrate_cost_model = calibrate_cost_model
        self.scheduler = scheduler
        self.executor = executor
        self.pipeline = pipeline
        if pipeline is not None and scheduler.config.steps_in_flight != pipeline.depth:
            raise ValueError(f"the scheduler plans for {scheduler.config.steps_in_flight} steps in "
                             f"flight, the pipeline keeps {pipeline.depth}")
        if scheduler.config.async_scheduling and pipeline is None:
            raise ValueError("asynchronous scheduling needs an executor that takes steps in flight")
        self._in_flight: deque[SchedulerOutput] = deque()  # submitted to `pipeline`, oldest first
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.requests: dict[str, Request] = {}
        # The text half of each step (output_processor.py); `step_core`'s caller may run it
        # elsewhere. `_reported`: per live request, its output tokens already in a core output.
        self.outputs = OutputProcessor(tokenizer, stream_outputs)
        self._reported: dict[str, int] = {}
        self._ids = itertools.count()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.step_seconds_total = 0.0
        self.predicted_step_seconds_total = 0.0
        self.requests_finished_total = 0
        self.last_step_tokens = 0  # tokens the latest step scheduled
        self.class_metrics = {priority: ClassMetrics() for priority in PRIORITIES}
        # Debug aid (the test suite turns it on): check the allocator's invariants every step.
        self.check_invariants = os.environ.get("NANOSERVE_CHECK_INVARIANTS") == "1"

    @property
    def config(self) -> SchedulerConfig:
        return self.scheduler.config

    def clock(self) -> float:
        """The scheduler's clock (time.monotonic, or a test's mock): one time base for arrival,
        token times and the policy's deadlines."""
        return self.scheduler.clock()

    @property
    def kv(self) -> KVManager:
        return self.scheduler.kv

    # -- requests --------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    arrival_time: float | None = None, prompt_text: str | None = None,
                    priority: RequestClass | str = RequestClass.ONLINE, slo: SLO | None = None) -> Request:
        """Queue a request. `prompt_text` names the text behind pre-tokenized prompts;
        `priority` is a RequestClass or its value ("online" or "offline"); `slo` overrides the
        class's latency targets."""
        token_ids = self.tokenize(prompt)
        self.validate(len(token_ids), params)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = Request(
            request_id, token_ids, params, eos_token_ids=self.eos_token_ids,
            prompt=prompt if isinstance(prompt, str) else prompt_text,
            arrival_time=arrival_time if arrival_time is not None else self.clock(),
            priority=RequestClass(priority), slo=slo if slo is not None else self.config.slo_for(priority),
        )
        if params.bad_words:
            request.bad_words_token_ids = self.bad_words_token_ids(params.bad_words)
        self.requests[request_id] = request
        self.outputs.add_request(request_id, request.prompt, token_ids, params)
        self._reported[request_id] = 0
        self.prompt_tokens_total += len(token_ids)
        if params.structured_outputs is not None:
            request.grammar_after_token = self._reasoning_end_token(token_ids)
            self._awaiting_grammar[request_id] = (request, self.grammar_compiler().submit(params.structured_outputs))
            return request
        self._schedule(request)
        return request

    def _schedule(self, request: Request) -> None:
        if request.grammar is not None or any(len(word) > 1 for word in request.bad_words_token_ids):
            self._constrained.add(request.request_id)
        self.scheduler.add_request(request)
        if self.scheduler.stops_running_batch_for(request):
            # ConServe Alg. 2: the policy wants the pure-offline forward in flight stopped; the
            # executor (ModelRunner.request_preemption) does it at its next safe point.
            self.executor.request_preemption()

    # -- structured outputs ----------------------------------------------------------------
    def grammar_backend(self) -> GrammarBackend:
        """The grammar library, made on first use (its tokenizer tables take ~0.2 s to build)."""
        if self._grammar_backend is None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need a tokenizer; this model has none")
            self._grammar_backend = make_backend(self.structured_outputs_backend, self.tokenizer,
                                                 self.vocab_size or self.tokenizer.vocab_size)
        return self._grammar_backend

    def grammar_compiler(self) -> GrammarCompiler:
        if self._grammar_compiler is None:
            self._grammar_compiler = GrammarCompiler(self.grammar_backend())
        return self._grammar_compiler

    def _reasoning_end_token(self, prompt: list[int]) -> int | None:
        """`</think>`'s id if the prompt leaves the model thinking (the template opened `<think>`
        and did not close it): its structured output starts after that token. vLLM's reasoning
        parsers gate the grammar the same way."""
        if self.reasoning_parser is None or self.tokenizer is None:
            return None
        start, end = self.tokenizer.token_to_id("<think>"), self.tokenizer.token_to_id("</think>")
        if start is None or end is None or start not in prompt:
            return None
        last_start = len(prompt) - 1 - prompt[::-1].index(start)
        return end if end not in prompt[last_start:] else None

    def _admit_compiled(self) -> list[EngineCoreOutput]:
        """Schedule the requests whose grammars have compiled; a failed compile ends its request
        (its final core output is returned)."""
        failed: list[EngineCoreOutput] = []
        if not self._awaiting_grammar:
            return failed
        if not self.scheduler.has_unfinished_requests() and not self._in_flight:
            # Nothing else to run: wait a little for a compile rather than spin.
            wait([f for _, f in self._awaiting_grammar.values()], timeout=0.05, return_when=FIRST_COMPLETED)
        for request_id, (request, future) in list(self._awaiting_grammar.items()):
            if not future.done():
                continue
            del self._awaiting_grammar[request_id]
            try:
                request.grammar = future.result().matcher()
            except Exception as exc:  # a constraint `check` passed that the library still refused
                request.stop_reason = f"structured_outputs: {exc}"
                self._finish_unscheduled(request)
                failed.append(self._core_output(request, self.clock()))
                continue
            self._schedule(request)
        return failed

    def _finish_unscheduled(self, request: Request) -> None:
        """End a request the scheduler never saw (still waiting for its grammar)."""
        request.status = RequestStatus.FINISHED_ABORTED
        request.finished_time = self.clock()
        self.requests_finished_total += 1

    def bad_words_token_ids(self, bad_words: Sequence[str]) -> list[list[int]]:
        """Each bad word as token ids, spelled at the start of a text and after a space (vLLM
        tokenizes it both ways too, so that neither "word" nor " word" gets through)."""
        if self.tokenizer is None:
            raise ValueError("bad_words needs a tokenizer; this engine has none")
        spellings: dict[tuple[int, ...], None] = {}
        for word in bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if ids:
                    spellings[ids] = None
        return [list(ids) for ids in spellings]

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is and free its KV. Unknown or finished ids are ignored."""
        core = self.abort_core(request_id)
        made = self.make_outputs([core] if core is not None else [])
        return made[0] if made else None

    def abort_core(self, request_id: str) -> EngineCoreOutput | None:
        """`abort_request`, for a caller that makes the outputs itself (`step_core`): the
        request's final core output, or None for an unknown or finished id."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        if self._awaiting_grammar.pop(request_id, None) is not None:
            self._finish_unscheduled(request)
            return self._core_output(request, self.clock())
        now = self.clock()
        self._finish(request, RequestStatus.FINISHED_ABORTED, now)
        if not self.has_unfinished_requests():
            self.scheduler.settle()
        return self._core_output(request, now)

    def stop_request(self, stop: StringStop) -> None:
        """End a request at the stop string the output processor found (`make_outputs`, or the
        caller of `step_core`): it finishes as stopped after the stop's token, at that token's
        time, and any tokens computed past it are dropped. Ignored if it has already finished
        (by EOS or its length at the same token, or an abort)."""
        request = self.requests.get(stop.request_id)
        if request is None or request.is_finished:
            return
        request.stop_reason = stop.stop
        self._finish(request, RequestStatus.FINISHED_STOPPED, stop.time, stop.num_output_tokens)
        self._forget(request.request_id)
        if not self.has_unfinished_requests():
            self.scheduler.settle()

    def output_processor(self) -> OutputProcessor:
        return self.outputs

    def make_outputs(self, core_outputs: Sequence[EngineCoreOutput]) -> list[RequestOutput]:
        """The text half of a step, on this thread: the engine's output processor makes the
        `RequestOutput`s, and the requests whose stop strings it found end here."""
        made, stops = self.outputs.process(core_outputs)
        for stop in stops:
            self.stop_request(stop)
        return made

    def detach_request(self, request_id: str) -> Handover:
        """Hand a request over to another engine (Llumnix's migration): it leaves this engine's
        queues and KV unfinished; its tokens and timings travel with the `Request`, its stream
        position and detokenizer in the `Handover` that `attach_request` takes."""
        if any(c.request.request_id == request_id for batch in self._in_flight for c in batch.chunks):
            raise ValueError(f"{request_id} is in a micro-batch still in flight; detach it after that lands")
        request = self.requests.pop(request_id)
        self.scheduler.detach(request)
        self._reported.pop(request_id, None)
        return Handover(request, self.outputs.detach(request_id))

    def attach_request(self, handover: Handover) -> None:
        """Go on serving a request `detach_request` took from another engine; its K/V must
        already be reserved in this engine's KV manager (the migration copied it)."""
        request = handover.request
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id!r} is already here")
        self.scheduler.attach(request)
        self.requests[request.request_id] = request
        self._reported[request.request_id] = request.num_output_tokens
        if handover.text is not None:
            self.outputs.attach(handover.text)

    def set_stream_outputs(self, stream: bool) -> bool:
        """Whether `step` returns an output for every request it advanced (True) or only for
        those that finished; returns the previous setting. `LLM.generate` turns it off while it
        runs: it needs only the finished requests, and an output per token costs a copy of the
        request's tokens so far."""
        previous, self.stream_outputs = self.stream_outputs, stream
        self.outputs.stream = stream
        return previous

    def use_executor(self, executor: Executor, pipeline: MicrobatchPipeline | None = None) -> None:
        """Run later steps on `executor` (KunServe's cluster member switching between its own
        runner and the pipeline group it joined), through `pipeline` (the same object, keeping
        steps in flight) or synchronously (None); the scheduler must already plan for that
        pipeline's depth (`Scheduler.keep_in_flight`). Only with no step in flight (`drain`)."""
        if self._in_flight:
            raise RuntimeError("cannot change executors with steps in flight")
        depth = pipeline.depth if pipeline is not None else 1
        if self.scheduler.config.steps_in_flight != depth:
            raise ValueError(f"the scheduler plans for {self.scheduler.config.steps_in_flight} steps in flight, "
                             f"the executor keeps {depth}")
        self.executor, self.pipeline = executor, pipeline

    def on_safe_point(self, callback: Callable[[], None]) -> None:
        """Have `callback` run at each safe point of a preemptible forward (ConServe Alg. 2 runs
        when an online request arrives, which may be in the middle of a forward: the server's
        loop and the simulation admit arrivals there). Only under a policy that can ask to stop
        the forward (`Scheduler.PREEMPTS_RUNNING_BATCH`): others see an arrival one step later."""
        if self.scheduler.PREEMPTS_RUNNING_BATCH:
            self.executor.on_safe_point(callback)

    def shutdown(self) -> None:
        """Stop the executor's worker processes, if it has any (tensor parallelism), and let go
        of the executor and the host KV store: the model's weights and the KV caches are freed
        once nothing else holds them, even while handles to this engine live on (a server's
        endpoints close over it, and FastAPI keeps endpoint functions in a cache of its own).
        Afterwards the engine can no longer step; its tokenizer, config and counters stay
        readable. Calling it again is fine."""
        self.executor.shutdown()
        self.executor, self.pipeline = STOPPED, None
        if self._grammar_compiler is not None:
            self._grammar_compiler.shutdown(wait=False)
        if self.kv.host_store is not None:  # the policy's host KV (swap, checkpoints, BE pages)
            self.kv.host_store.release()

    @property
    def steps_in_flight(self) -> int:
        """Steps submitted to an asynchronous pipeline and not landed yet."""
        return len(self._in_flight)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight) or bool(self._awaiting_grammar)

    def unfinished_request_ids(self) -> list[str]:
        return list(self.requests)

    def supports_prompt_logprobs(self) -> bool:
        return self.executor.supports_prompt_logprobs()

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (vLLM's `reset_prefix_cache`: after weights change, or to
        benchmark cold); running requests keep their blocks. Returns the blocks forgotten."""
        return self.kv.reset_prefix_cache()

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            kv_blocks_used=self.kv.num_used_blocks, kv_blocks_total=self.kv.num_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            requests_finished_total=self.requests_finished_total,
            kv_events=dict(self.kv.events),
            per_class={priority: m.summary() for priority, m in self.class_metrics.items()},
            step_seconds_total=self.step_seconds_total,
            predicted_step_seconds_total=self.predicted_step_seconds_total,
            policy_counters=self.scheduler.counters(),
        )

    # -- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Advance every scheduled request by one step; return outputs of those that changed."""
        return self.make_outputs(self.step_core())

    def step_core(self) -> list[EngineCoreOutput]:
        """`step` up to its text: the core outputs of the requests that changed, for a caller
        that makes the outputs itself (the output processor `outputs`, on a thread of its own;
        the `StringStop`s it finds go to `stop_request`)."""
        failed = self._admit_compiled()
        if failed:
            return failed + self._step_core()
        return self._step_core()

    def _step_core(self) -> list[EngineCoreOutput]:
        if self.pipeline is not None:
            return self._pipelined_step(self.pipeline)
        # The scheduler's clock: wall time in a server, virtual time in the simulator, where the
        # policy's cost model is calibrated against the simulated GPU as it is against a real one.
        started = self.clock()
        batch = self.scheduler.schedule()
        self._scheduled(batch, started)
        if batch.is_empty:
            # Nothing could be scheduled: what is missing is held by copies still in flight (a
            # save's blocks), so wait for the copy stream rather than spin; nothing to overlap.
            self.scheduler.settle()
            return []
        result = self.executor.execute(batch)
        outputs: list[EngineCoreOutput] = []
        # ConServe's layer-wise preemption (conserve.txt §4.3): the runner stopped a pure-offline
        # forward at a safe point for an online arrival. The step is discarded: no request
        # advances or samples, so none loses a token; the K/V it wrote past num_computed_tokens
        # is overwritten when its chunks run again; its KV copies did run, as the manager assumes.
        if not result.preempted:
            self.scheduler.update_after_step(batch)
            outputs = self._postprocess(batch, result, self.clock())
            # The whole step, as a client's TPOT sees it: scheduling, forward, sampling, output.
            measured = self.clock() - started
            predicted = self.scheduler.cost_model.predict_output(batch)  # by the model the policy used
            self.step_seconds_total += measured
            self.predicted_step_seconds_total += predicted
            if self.calibrate_cost_model:
                self.scheduler.calibrate(predicted, measured)
        return self._end_step(outputs)

    def _scheduled(self, batch: SchedulerOutput, now: float) -> None:
        """Note what this step scheduled: its tokens (the server's iteration-tokens histogram)
        and when each request was first scheduled (its queue time ends there)."""
        self.last_step_tokens = batch.num_tokens
        for chunk in batch.chunks:
            if chunk.request.first_scheduled_time is None:
                chunk.request.first_scheduled_time = now

    def _end_step(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        if not self.has_unfinished_requests():
            self.scheduler.settle()  # idle from here: free what the last copies held
        if self.check_invariants:
            self.kv.check_invariants()
        return outputs

    def _pipelined_step(self, pipeline: MicrobatchPipeline) -> list[EngineCoreOutput]:
        """Submit one more micro-batch if the pipeline has room and the policy has work; when it
        is full (or nothing else can run until a token lands), collect the oldest and
        postprocess it. Returns [] while it is still filling. The cost model is not calibrated
        here: with steps overlapping, no interval measures one step's cost. A clocked pipeline
        (`MicrobatchPipeline.clocked`) gets a step every time, empty if need be, and is
        collected from only when full: its stages move on only when a step is submitted."""
        clocked = pipeline.clocked
        try:
            # A grammar's next mask needs the token in flight accepted first: while a constrained
            # request lives, one step at a time (ours; vLLM v1 overlaps them with more machinery).
            # A clocked pipeline never runs a request with a token in flight (`schedulable`).
            one_at_a_time = self._constrained and not clocked
            if len(self._in_flight) < pipeline.depth and not (one_at_a_time and self._in_flight):
                batch = self.scheduler.schedule()
                self._scheduled(batch, self.clock())
                if clocked or not batch.is_empty:
                    self._submit(pipeline, batch)
                    if len(self._in_flight) < pipeline.depth and not one_at_a_time:
                        return []
            if not self._in_flight:
                self.scheduler.settle()  # nothing runs and nothing is in flight: as `step` does
                return []
            landed = self._land(pipeline)
        except BaseException:
            self._discard_in_flight(pipeline)
            raise
        return self._end_step(landed)

    def drain(self) -> list[RequestOutput]:
        """Land every step in flight and schedule nothing new: before the executor changes (a
        KunServe member's layout), or before anything outside the pipeline reuses blocks a step
        in flight may still write (a background restore's pull). A clocked pipeline is first
        given `depth` - 1 empty steps, which carry the latest real one through every stage; that
        count is the same on every member of a KunServe group, as the group's shared steps need."""
        pipeline = self.pipeline
        if pipeline is None or not self._in_flight:
            return []
        outputs: list[EngineCoreOutput] = []
        try:
            if pipeline.clocked:
                for _ in range(pipeline.depth - 1):
                    self._submit(pipeline, SchedulerOutput([]))
            while self._in_flight:
                outputs.extend(self._land(pipeline))
        except BaseException:
            self._discard_in_flight(pipeline)
            raise
        return self.make_outputs(self._end_step(outputs))

    def _submit(self, pipeline: MicrobatchPipeline, batch: SchedulerOutput) -> None:
        self.scheduler.update_after_submit(batch)
        self._in_flight.append(batch)
        pipeline.submit(batch)

    def _land(self, pipeline: MicrobatchPipeline) -> list[EngineCoreOutput]:
        """Collect the oldest step in flight and postprocess it."""
        result = pipeline.collect()
        batch = self._in_flight.popleft()
        self.scheduler.update_after_landing(batch)
        return self._postprocess(batch, result, self.clock())

    def discard_in_flight(self) -> None:
        """Forget the steps in flight: their pipeline failed (a worker or a KunServe group's
        peer is gone), so their tokens never come. Their requests keep what they had; the
        caller aborts or recomputes them."""
        if self.pipeline is not None:
            self._discard_in_flight(self.pipeline)

    def _discard_in_flight(self, pipeline: MicrobatchPipeline) -> None:
        for batch in self._in_flight:
            self.scheduler.update_after_landing(batch)
        self._in_flight.clear()
        pipeline.discard_in_flight()

    def _postprocess(self, batch: SchedulerOutput, result: ExecutorOutput, now: float) -> list[EngineCoreOutput]:
        outputs = []
        for request_id, (first, rows) in result.prompt_logprobs.items():
            request = self.requests.get(request_id)
            if request is not None and request.prompt_logprobs is not None:
                # A chunk computed again (after a recompute preemption) repeats rows we have.
                have = len(request.prompt_logprobs)
                request.prompt_logprobs.extend(rows[have - first:] if first <= have else ())
        for chunk in batch.chunks:
            request = chunk.request
            token = result.sampled.get(request.request_id)
            if token is None or request.is_finished:
                continue
            request.append_token(token, now)
            self.generation_tokens_total += 1
            if request.grammar is not None and not self._advance_grammar(request, token):
                # The mask allowed only what the grammar takes, so this is a bug, not the model's:
                # end this request, keep serving the others.
                log.error("%s: token %d is not in its grammar; the request is aborted", request.request_id, token)
                request.stop_reason = "structured_outputs: the output left its grammar"
                self._finish(request, RequestStatus.FINISHED_ABORTED, now)
                outputs.append(self._core_output(request, now))
                continue
            if request.logprobs is not None:
                request.logprobs.append(result.logprobs[request.request_id])
            status = self._stop_status(request, token)
            if status is not None:
                self._finish(request, status, now)
            # The output processor needs each token of a request with stop strings at once, to
            # end it there; the others' tokens can wait for their finish unless streamed.
            if self.stream_outputs or status is not None or request.params.stop_strings:
                outputs.append(self._core_output(request, now))
        return outputs

    @staticmethod
    def _advance_grammar(request: Request, token: int) -> bool:
        """Step the request's grammar past its new token (or, while it still reasons, wait for
        the token that ends the reasoning); False if the grammar refuses the token."""
        assert request.grammar is not None
        if request.grammar_after_token is not None:
            if token == request.grammar_after_token:
                request.grammar_after_token = None
            return True
        return request.grammar.accept(token)

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        """Whether `token` ends the request, by what the engine can see without its text; stop
        strings are the output processor's (`make_outputs`)."""
        params = request.params
        # vLLM's min_tokens: no stop of any kind (EOS, stop tokens, stop strings) before it.
        may_stop = request.num_output_tokens >= params.min_tokens
        if request.grammar is not None and request.grammar.is_terminated():
            return RequestStatus.FINISHED_STOPPED  # the output is complete: its grammar took EOS
        if may_stop and not params.ignore_eos and token in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if may_stop and params.stop_token_ids and token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus, now: float,
                num_output_tokens: int | None = None) -> None:
        """End the request and free its KV. `num_output_tokens`: where its output ends, if
        tokens past that were computed (a stop string found after they were)."""
        if request.is_finished:
            return
        self.scheduler.finish_request(request, status)
        if num_output_tokens is not None:  # after the KV is freed: its blocks hold what was computed
            request.truncate_output(num_output_tokens)
        request.finished_time = now
        self.requests_finished_total += 1
        if status != RequestStatus.FINISHED_ABORTED:
            metrics = self._metrics(request)
            self.class_metrics[request.priority].observe(metrics.ttft, metrics.tpot, metrics.num_output_tokens,
                                                         request.slo, request.arrival_time, now)

    def _core_output(self, request: Request, now: float) -> EngineCoreOutput:
        """The request's tokens and logprobs since its last core output, at its finish time if it
        finished; a finished request is forgotten here. Its prompt logprobs go in its first core
        output only: they are complete once it samples, and no later step changes them."""
        rid = request.request_id
        reported = self._reported.get(rid, 0)
        self._reported[rid] = len(request.token_ids) - len(request.prompt_token_ids)
        finish_reason = request.finish_reason
        output = EngineCoreOutput(
            rid, request.token_ids[len(request.prompt_token_ids) + reported:],
            request.logprobs[reported:] if request.logprobs is not None else None,
            finish_reason, request.stop_reason,
            now if request.finished_time is None else request.finished_time,
            request.arrival_time, request.first_scheduled_time, request.first_token_time, request.num_preemptions,
            request.num_cached_tokens or 0,
            list(request.prompt_logprobs) if request.prompt_logprobs is not None and not reported else None,
        )
        if finish_reason is not None:
            self._forget(rid)
        return output

    def _forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self._reported.pop(request_id, None)
        self._constrained.discard(request_id)

    @staticmethod
    def _metrics(request: Request) -> RequestMetrics:
        return RequestMetrics.of(request.arrival_time, request.first_scheduled_time, request.first_token_time,
                                 request.finished_time, request.num_prompt_tokens, request.num_output_tokens,
                                 request.num_preemptions)
