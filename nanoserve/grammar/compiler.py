"""`GrammarCompiler`: grammars compile on a worker thread, off the engine's step, and are cached.

Compiling a grammar takes from under a millisecond (a small JSON schema with llguidance) to
seconds (a large schema, or any schema with a backend that precomputes masks). Done inside the
engine's step it would stall every running request for that long, so vLLM compiles on a thread
pool and a request waits (its state WAITING_FOR_FSM) until its grammar is ready. nanoserve does
the same: `submit(spec)` returns at once with a `Future`, and the engine schedules the request
once `future.done()`; a compile error (ValueError) comes out of `future.result()`.

The cache holds the futures, keyed by the constraint (`StructuredOutputsParams.key`), so a second
request with the same schema -- even one that arrives while the first compile is still running --
gets the same future and the same `CompiledGrammar`. It is an LRU of `cache_size` entries. A
failed compile is dropped from it when it fails, so that a retry compiles again.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from nanoserve.grammar.backend import GrammarBackend
from nanoserve.grammar.compiled import CompiledGrammar
from nanoserve.structured_outputs import StructuredOutputsKind, StructuredOutputsParams

CompileKey = tuple[StructuredOutputsKind, str]


class GrammarCompiler:
    """Compiles constraints with `backend` on `max_workers` threads, caching the last `cache_size`."""

    def __init__(self, backend: GrammarBackend, max_workers: int = 1, cache_size: int = 256) -> None:
        if max_workers < 1 or cache_size < 1:
            raise ValueError(f"max_workers and cache_size must be >= 1, got {max_workers} and {cache_size}")
        self.backend = backend
        self._cache_size = cache_size
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="nanoserve-grammar")
        self._cache: OrderedDict[CompileKey, Future[CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()  # the cache is touched by the caller and by finished compiles

    def submit(self, spec: StructuredOutputsParams) -> Future[CompiledGrammar]:
        """The compiled grammar for `spec`, as a future: cached, in flight, or compiling from now."""
        key = spec.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self.backend.compile, spec)
            self._cache[key] = future
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)  # an evicted future still completes for its waiters
        future.add_done_callback(lambda done: self._forget_failure(key, done))
        return future

    def _forget_failure(self, key: CompileKey, future: Future[CompiledGrammar]) -> None:
        if future.cancelled() or future.exception() is not None:
            with self._lock:
                if self._cache.get(key) is future:
                    del self._cache[key]

    def __len__(self) -> int:
        """How many constraints are cached or compiling."""
        with self._lock:
            return len(self._cache)

    def shutdown(self, wait: bool = True) -> None:
        """Stop the worker threads; compiles not yet started are cancelled."""
        self._pool.shutdown(wait=wait, cancel_futures=True)
