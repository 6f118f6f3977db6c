"""`ServingEngine`: what a serving loop (async_engine.py's `AsyncEngine`, behind the OpenAI server)
needs of an engine. Two things are one:

    Engine                     engine.py: one model replica (or one tensor/pipeline-parallel group)
    ClusterEngine              cluster/cluster_engine.py: KunServe's cluster of replicas, its
                               dispatcher, drops and restores (kunserve.txt §3, §4)

The loop calls only what is declared here, all of it from its own thread but `tokenize`,
`validate`, the facts (`tokenizer`, `model_name`, `config`, `reasoning_parser`,
`sampling_defaults`) and `grammar_backend`, which a handler calls from the event loop to refuse a
bad request before it is queued: those must read only what does not change after the build.

Capabilities an engine may lack are methods with defaults here (`on_safe_point`,
`reset_prefix_cache`, `cluster_stats`, `supports_prompt_logprobs`, `grammar_backend`,
`output_processor` with `step_core`, `abort_core` and `stop_request`); an engine that has one
overrides it, and nobody asks an engine what it is.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any

from nanoserve.cluster_stats import ClusterStats
from nanoserve.config import SchedulerConfig
from nanoserve.engine_stats import EngineStats
from nanoserve.grammar import GrammarBackend
from nanoserve.output_processor import OutputProcessor
from nanoserve.outputs import EngineCoreOutput, RequestOutput, StringStop
from nanoserve.sampling import SamplingParams
from nanoserve.slo import SLO, RequestClass
from nanoserve.tokenizer import Tokenizer


class ServingEngine(ABC):
    # Facts, fixed when the engine is built (read from any thread).
    model_name: str
    tokenizer: Tokenizer | None
    reasoning_parser: str | None  # the reasoning format the model writes (EngineArgs.reasoning_parser)
    sampling_defaults: Mapping[str, Any]  # the model's recommended sampling (generation_config.py)
    last_step_tokens: int  # tokens the latest `step` scheduled (all instances' together in a cluster)

    @property
    @abstractmethod
    def config(self) -> SchedulerConfig:
        """The per-step limits (max_model_len, the classes' SLOs) requests are checked against."""

    # -- requests ----------------------------------------------------------------------------
    @abstractmethod
    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    arrival_time: float | None = None, prompt_text: str | None = None,
                    priority: RequestClass | str = RequestClass.ONLINE, slo: SLO | None = None) -> object:
        """Queue a request (its outputs come from later `step`s). Raises ValueError for a request
        that can never be served or an id in use. Returns the engine's handle of the request
        (`Engine`: the `Request`); the serving loop ignores it."""

    @abstractmethod
    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop the request wherever it is and free its KV; its final (aborted) output, or None
        for an unknown or finished id."""

    @abstractmethod
    def step(self) -> list[RequestOutput]:
        """Advance the requests by one step; the outputs of those that changed."""

    @abstractmethod
    def has_unfinished_requests(self) -> bool: ...

    @abstractmethod
    def unfinished_request_ids(self) -> list[str]:
        """Every request added and neither finished nor aborted (the loop aborts them on failure)."""

    @abstractmethod
    def stats(self) -> EngineStats:
        """A snapshot of the counts and counters (the loop publishes one after each step)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Free the model, the KV and any process the engine started; calling it again is fine."""

    # -- capabilities, with what an engine without them does ------------------------------------
    def cluster_stats(self) -> ClusterStats | None:
        """The cluster's own state (instances, layout changes, throttling); None: not a cluster."""
        return None

    def on_safe_point(self, callback: Callable[[], None]) -> None:
        """Have `callback` run at each safe point of a forward in flight (ConServe Alg. 2 admits
        arrivals there). Default: the forwards have none; arrivals wait for the step's end."""

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix; returns the blocks forgotten. Default: nothing is cached."""
        return 0

    def supports_prompt_logprobs(self) -> bool:
        """Whether a request may ask for its prompt's logprobs."""
        return True

    def grammar_backend(self) -> GrammarBackend:
        """The structured-output library requests' constraints are checked with. Default: none."""
        raise ValueError("structured outputs are not supported by this engine")

    # -- outputs made off the engine's thread (output_processor.py) ---------------------------
    def output_processor(self) -> OutputProcessor | None:
        """The processor that makes this engine's outputs from its core outputs, where a caller
        may run it on a thread of its own: `step_core`, `abort_core` and `stop_request` then
        replace `step` and `abort_request` (the server's output thread, async_engine.py).
        Default: None, the engine makes its outputs in `step` (a cluster's come built from
        its instances' processes)."""
        return None

    def step_core(self) -> list[EngineCoreOutput]:
        """`step` without its text: the core outputs for `output_processor()`."""
        raise NotImplementedError("this engine makes its outputs in step()")

    def abort_core(self, request_id: str) -> EngineCoreOutput | None:
        """`abort_request` without its text: the request's final core output, or None."""
        raise NotImplementedError("this engine makes its outputs in abort_request()")

    def stop_request(self, stop: StringStop) -> None:
        """End a request at a stop string `output_processor()` found."""
        raise NotImplementedError("this engine finds its stop strings itself")

    # -- checks a handler runs before anything is queued ----------------------------------------
    def validate(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Raise ValueError if a request could never be served. The message is client-facing."""
        limit = self.config.max_model_len
        if params.prompt_logprobs is not None and not self.supports_prompt_logprobs():
            raise ValueError("prompt_logprobs is not supported by this engine's executor "
                             "(pipeline parallelism computes no prompt logits)")
        if params.structured_outputs is not None:
            self.grammar_backend().check(params.structured_outputs)  # ValueError naming the field
        if num_prompt_tokens < 1:
            raise ValueError("the prompt must contain at least one token")
        if num_prompt_tokens + params.max_tokens > limit:
            raise ValueError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + params.max_tokens} tokens ({num_prompt_tokens} in the prompt, "
                f"{params.max_tokens} in the completion). Please reduce the prompt or max_tokens."
            )

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """A text prompt's token ids, or token ids checked against the vocabulary."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer; pass token ids")
            return self.tokenizer.encode(prompt)
        vocab = self.tokenizer.vocab_size if self.tokenizer is not None else None
        if any(not isinstance(t, int) or t < 0 or (vocab is not None and t >= vocab) for t in prompt):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        return list(prompt)
