"""The engine behind the server: one background thread runs the engine's `step()` in a loop, and
asyncio handlers talk to it through queues.

    handler ──generate()──► inbox ──► engine thread: add/abort, step(), ──► per-request queue
       ▲                                                                        │
       └───────────────────────── async for output in stream ◄──────────────────┘

With `output_thread` (the default), the engine thread stops at the core outputs
(`step_core`) and a second thread makes the outputs: it detokenizes, finds stop strings and
builds each request's snapshot while the engine thread schedules and launches the next step or
waits for the device (output_processor.py; vLLM v1 runs this in another process). A stop string
it finds goes back through the inbox (`stop_request`). Errors and outputs reach a stream through
that thread in the order the engine made them.

    engine thread: step_core() ──► output queue ──► output thread: process() ──► per-request queue
                         ▲                                   │
                         └──────── inbox: StringStop ◄───────┘

The engine is any `ServingEngine` (serving.py): one `Engine`, or KunServe's cluster behind its
adapter (`ClusterEngine`, `nanoserve serve --instances N`); this loop calls only the interface.

Only the engine thread touches the engine's mutable state. Handlers validate and tokenize in
their own task (pure functions of the config and tokenizer), so a bad request is refused before
anything is queued. A stream that is closed early (the client went away) aborts its request,
which frees its KV blocks at the next step. If a step raises, every request in flight fails
with that error and is aborted; the loop then carries on serving new requests.

Which thread builds the engine matters on a CPU (ours; issue 23). PyTorch's CPU ops run their
parallel regions through libgomp (GNU OpenMP), which keeps one pool of worker threads for each
thread that has started a region, for as long as that thread lives. An engine built on the
server's main thread (loading, packing the weights, the first forwards) leaves a pool there;
the engine thread then makes a second. Two pools on N cores are 2N threads, more than the
cores, and libgomp then throttles how long an idle worker spins before it sleeps: each of the
step's parallel regions waits for a sleeping worker to be woken. Measured on a 2-core EPYC
(AVX512-BF16; SmolLM2): one packed fp32 linear layer at one row took 38 us from the only
pool's thread and 95 us from the second pool's; a decode step at batch 1 22.4 against 29.7 ms
in fp32, 16.8 against 28.6 ms in bf16; served in-process at Poisson 1/s (bf16), TPOT p50 19.5
against 32.2 ms. So `AsyncEngine.build` runs the build on a short-lived thread, whose pool
ends with it, and the engine thread's pool is the only one while serving.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from nanoserve.cluster_stats import ClusterStats
from nanoserve.engine_stats import EngineStats
from nanoserve.output_processor import OutputProcessor
from nanoserve.outputs import EngineCoreOutput, RequestOutput, StringStop
from nanoserve.sampling import SamplingParams
from nanoserve.serving import ServingEngine
from nanoserve.slo import SLO, RequestClass
from nanoserve.tokenizer import Tokenizer

log = logging.getLogger("nanoserve.engine")
T = TypeVar("T")


class EngineError(RuntimeError):
    """The engine failed while serving a request (not the request's fault)."""


@dataclass(frozen=True)
class _Add:
    request_id: str
    token_ids: list[int]
    prompt: str | None
    params: SamplingParams
    sink: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    priority: RequestClass = RequestClass.ONLINE
    slo: SLO | None = None

    def __post_init__(self) -> None:
        # "online"/"offline" too; a bad value raises here, in the caller, before anything is queued.
        object.__setattr__(self, "priority", RequestClass(self.priority))


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Call:
    """Run `fn(engine)` on the engine thread between steps; its result or error goes to `future`."""
    fn: Callable[[ServingEngine], Any]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


@dataclass(frozen=True)
class _Stop:
    """End a request at the stop string the output thread found."""
    stop: StringStop


Message = _Add | _Abort | _Call | _Stop


@dataclass(frozen=True)
class _Core:
    """Core outputs for the output thread to make outputs of."""
    outputs: list[EngineCoreOutput]


@dataclass(frozen=True)
class _Failed:
    """The request failed (`error` goes to its stream); the output thread forgets it."""
    request_id: str
    error: BaseException


class AsyncEngine:
    @classmethod
    def build(cls, make_engine: Callable[[], ServingEngine], output_thread: bool = True) -> AsyncEngine:
        """`AsyncEngine(make_engine(), output_thread)`, run on a thread of its own that has ended
        when this returns: the way to start a server's engine (the module docstring says why).
        Built there, the AsyncEngine takes the CUDA device build_engine set on that thread.
        Exceptions from the build propagate."""
        with ThreadPoolExecutor(1, thread_name_prefix="nanoserve-build") as pool:  # joined on exit
            return pool.submit(lambda: cls(make_engine(), output_thread)).result()

    def __init__(self, engine: ServingEngine, output_thread: bool = True):
        """`output_thread`: make the outputs on a thread of their own (the module docstring),
        where the engine lets its caller (`ServingEngine.output_processor`)."""
        self.engine = engine
        self._inbox: queue.SimpleQueue[Message | None] = queue.SimpleQueue()
        # Written by handlers (generate), read and emptied by the thread that delivers outputs.
        self._sinks: dict[str, tuple[asyncio.Queue, asyncio.AbstractEventLoop]] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        # CUDA's current device is per thread: the engine thread takes the one the engine was
        # built on (build_engine set it), or Triton and the copy streams would use cuda:0.
        self._cuda_device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        self._processor: OutputProcessor | None = engine.output_processor() if output_thread else None
        self._outbox: queue.SimpleQueue[_Core | _Failed | None] = queue.SimpleQueue()
        self._output_thread: threading.Thread | None = None
        self._stats = engine.stats()
        self._cluster_stats = engine.cluster_stats()
        # Called from the engine thread with each step's wall-clock seconds (the server's metrics).
        # Told of each step that ran: its wall-clock seconds and the tokens it scheduled.
        self.step_observers: list[Callable[[float, int], None]] = []
        self.last_error: str | None = None
        self._deferred: list[_Abort | _Call | _Stop | None] = []  # inbox messages that must wait for the step's end
        # ConServe's Alg. 2 runs when an online request arrives, which may be in the middle of a
        # forward pass; the runner's safe points let this loop take arrivals in then. Only for
        # a policy that can ask to stop the forward: others see the arrival one step later.
        engine.on_safe_point(self._admit_arrivals)

    # -- facts handlers need -------------------------------------------------------------
    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.config.max_model_len

    @property
    def reasoning_parser(self) -> str | None:
        """The reasoning format the model writes (`EngineArgs.reasoning_parser`), or None."""
        return self.engine.reasoning_parser

    @property
    def sampling_defaults(self) -> Mapping[str, Any]:
        """The model's recommended sampling (generation_config.py), fixed when the engine is built."""
        return self.engine.sampling_defaults

    def default_slo(self, priority: RequestClass | str) -> SLO:
        """The latency targets of a request class (the config is immutable: safe from any thread)."""
        return self.engine.config.slo_for(priority)

    def stats(self) -> EngineStats:
        """A snapshot taken by the engine thread after its latest step."""
        return self._stats

    def cluster_stats(self) -> ClusterStats | None:
        """The cluster's snapshot taken with `stats` (None: the engine is not a cluster)."""
        return self._cluster_stats

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def makes_outputs_on_own_thread(self) -> bool:
        """Whether a thread of their own makes the outputs (the module docstring)."""
        return self._processor is not None

    def thread_ids(self) -> dict[str, int | None]:
        """The OS ids of the engine thread and the output thread (None: not running), for a
        benchmark that reads their CPU time."""
        return {"engine": self._thread.native_id if self._thread is not None else None,
                "outputs": self._output_thread.native_id if self._output_thread is not None else None}

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        if self.is_running:
            return
        if self._processor is not None:
            self._output_thread = threading.Thread(target=self._output_loop, args=(self._processor,),
                                                   name="nanoserve-outputs", daemon=True)
            self._output_thread.start()
        self._thread = threading.Thread(target=self._loop, name="nanoserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._thread is None:
            return
        self._inbox.put(None)
        self._thread.join(timeout)
        self._thread = None
        if self._output_thread is not None:  # after the engine thread's last outputs and errors
            self._outbox.put(None)
            self._output_thread.join(timeout)
            self._output_thread = None

    # -- the handler side ----------------------------------------------------------------
    def prepare(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Tokenize and validate; raises ValueError with a client-facing message."""
        token_ids = self.engine.tokenize(prompt)
        self.engine.validate(len(token_ids), params)
        return token_ids

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None, priority: RequestClass | str = RequestClass.ONLINE,
                       slo: SLO | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs until it finishes. Raises ValueError before streaming
        for a request that can never be served, EngineError if the engine fails mid-way."""
        token_ids = self.prepare(prompt, params)
        if not self.is_running:  # a queued request would wait forever
            raise EngineError("the engine is not running")
        request_id = request_id or f"req-{next(self._ids)}"
        sink: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        entry = (sink, loop)
        if self._sinks.setdefault(request_id, entry) is not entry:  # atomic: one of two handlers wins
            raise ValueError(f"request id {request_id!r} is already in use")
        self._inbox.put(_Add(request_id, token_ids, prompt if isinstance(prompt, str) else None,
                             params, sink, loop, RequestClass(priority), slo))
        finished = False
        try:
            while True:
                item = await sink.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:  # the consumer stopped early: the client is gone
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    async def call(self, fn: Callable[[ServingEngine], T]) -> T:
        """`fn(engine)`, run on the engine thread between two steps (the engine's state is that
        thread's alone); raises what it raises."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._inbox.put(_Call(fn, future, loop))
        return await future

    async def reset_prefix_cache(self) -> int:
        """`ServingEngine.reset_prefix_cache` between steps; returns the blocks forgotten."""
        return await self.call(lambda engine: engine.reset_prefix_cache())

    # -- the engine thread ---------------------------------------------------------------
    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        """Hand an output or error to its stream (from the thread that makes outputs)."""
        sink = self._sinks.get(request_id)
        if sink is None:
            return
        if isinstance(item, BaseException) or item.finished:
            self._sinks.pop(request_id, None)
        q, loop = sink
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:  # the handler's event loop has closed
            pass

    def _handle(self, message: Message) -> None:
        if isinstance(message, _Call):
            try:
                result = message.fn(self.engine)
            except Exception as exc:
                self._settle(message, exc)
            else:
                self._settle(message, result)
            return
        if isinstance(message, _Abort):
            if self._processor is not None:
                core = self.engine.abort_core(message.request_id)
                if core is not None:
                    self._outbox.put(_Core([core]))
            else:
                out = self.engine.abort_request(message.request_id)
                if out is not None:
                    self._deliver(message.request_id, out)
            return
        if isinstance(message, _Stop):
            self.engine.stop_request(message.stop)
            return
        try:
            self.engine.add_request(message.token_ids, message.params, message.request_id,
                                    prompt_text=message.prompt, priority=message.priority, slo=message.slo)
        except Exception as exc:  # e.g. a duplicate id: the request's own problem
            self._fail(message.request_id, exc)

    def _fail(self, request_id: str, error: BaseException) -> None:
        """Send a request's error to its stream, after the outputs made before it."""
        if self._processor is not None:
            self._outbox.put(_Failed(request_id, error))
        else:
            self._deliver(request_id, error)

    @staticmethod
    def _settle(call: _Call, outcome: Any) -> None:
        def settle() -> None:
            if call.future.done():  # the handler gave up waiting
                return
            if isinstance(outcome, BaseException):
                call.future.set_exception(outcome)
            else:
                call.future.set_result(outcome)
        try:
            call.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the handler's event loop has closed
            pass

    def _admit_arrivals(self) -> None:
        """At a safe point of a forward in flight: add the requests that arrived since the step
        began, so the policy can decide (Alg. 2) whether this forward should stop. Aborts, calls and
        shutdown wait for the step's end: the forward still reads the aborted requests' KV."""
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(message, _Add):
                self._handle(message)
            else:
                self._deferred.append(message)

    def _next_message(self, block: bool) -> Message | None:
        if self._deferred:
            return self._deferred.pop(0)
        return self._inbox.get(block=block, timeout=0.5 if block else None)

    def _loop(self) -> None:
        if self._cuda_device is not None:
            torch.cuda.set_device(self._cuda_device)
        while True:
            # Block for work when idle; otherwise drain whatever arrived during the last step.
            block = not self.engine.has_unfinished_requests()
            try:
                while True:
                    message = self._next_message(block)
                    if message is None:
                        self._fail_all(EngineError("the server is shutting down"))
                        return
                    self._handle(message)
                    block = False
            except queue.Empty:
                pass
            if not self.engine.has_unfinished_requests():
                self._publish_stats()
                continue
            try:
                started = time.perf_counter()
                if self._processor is not None:
                    core = self.engine.step_core()
                    if core:
                        self._outbox.put(_Core(core))
                    outputs = []
                else:
                    outputs = self.engine.step()
                for observe in self.step_observers:
                    observe(time.perf_counter() - started, self.engine.last_step_tokens)
            except Exception as exc:
                log.error("engine step failed:\n%s", traceback.format_exc())
                self.last_error = f"{type(exc).__name__}: {exc}"
                self._fail_all(EngineError(f"the engine failed while serving this request: {self.last_error}"))
                outputs = []
            for out in outputs:
                self._deliver(out.request_id, out)
            self._publish_stats()

    # -- the output thread ----------------------------------------------------------------
    def _output_loop(self, processor: OutputProcessor) -> None:
        """Make and deliver the outputs of the engine thread's core outputs, in its order; send
        the stop strings found back to it."""
        while True:
            item = self._outbox.get()
            if item is None:
                return
            if isinstance(item, _Failed):
                processor.forget(item.request_id)
                self._deliver(item.request_id, item.error)
                continue
            try:
                made, stops = processor.process(item.outputs)
            except Exception as exc:  # a bug here: fail these requests, keep serving the rest
                log.error("making outputs failed:\n%s", traceback.format_exc())
                error = EngineError(f"the engine failed while serving this request: {type(exc).__name__}: {exc}")
                for core in item.outputs:
                    processor.forget(core.request_id)
                    self._deliver(core.request_id, error)
                    self._inbox.put(_Abort(core.request_id))
                continue
            for stop in stops:
                self._inbox.put(_Stop(stop))
            for out in made:
                self._deliver(out.request_id, out)

    def _publish_stats(self) -> None:
        self._stats = self.engine.stats()
        self._cluster_stats = self.engine.cluster_stats()

    def _fail_all(self, error: EngineError) -> None:
        for request_id in self.engine.unfinished_request_ids():
            if self._processor is not None:
                self.engine.abort_core(request_id)  # its output processor forgets it on `_fail`
            else:
                self.engine.abort_request(request_id)
            self._fail(request_id, error)
        for request_id in list(self._sinks):
            self._fail(request_id, error)
