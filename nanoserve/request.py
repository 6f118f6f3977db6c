"""A request's state as it moves through the engine.

    WAITING ──schedule──► RUNNING ──finish──► FINISHED_{STOPPED,LENGTH,ABORTED}
       ▲                     │
       └──────preempt────────┘   (KV freed; the tokens are kept and recomputed on resume)

The scheduler owns the transitions between WAITING and RUNNING; the engine owns the finish.
`num_computed_tokens` counts the tokens whose K/V sit in the cache. Each step schedules some
of the rest; a request samples a new token only when a step brings it level with
`num_tokens`, so a prompt chunked over several steps samples once, at its last chunk.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nanoserve.sampling import SamplingParams
from nanoserve.slo import SLO, RequestClass

if TYPE_CHECKING:
    import torch

    from nanoserve.grammar import GrammarMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in _FINISHED  # a set lookup: the engine asks for every request every step


_FINISHED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED})


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    # ONLINE (latency-critical: BROS's real-time, ConServe's online) or OFFLINE (BROS's
    # best-effort, batch work). Policies and memory managers read it; nothing else does.
    # "online"/"offline" strings are accepted and coerced to the member.
    priority: RequestClass = RequestClass.ONLINE
    slo: SLO = field(default_factory=SLO)  # latency targets; the engine fills in the class default

    status: RequestStatus = RequestStatus.WAITING
    token_ids: list[int] = field(init=False)  # prompt followed by generated tokens
    num_computed_tokens: int = 0
    # Tokens sampled by steps still in flight and not yet appended (an asynchronous pipeline or
    # asynchronous scheduling, engine.py): their positions may already be computed, so
    # `num_computed_tokens` can exceed `num_tokens` by this much. vLLM v1's output placeholders.
    num_pending_tokens: int = 0
    num_preemptions: int = 0
    # Prompt tokens whose K/V came from the prefix cache when the request was first scheduled
    # (OpenAI's usage.prompt_tokens_details.cached_tokens); None until then.
    num_cached_tokens: int | None = None
    # The chain hashes of its full blocks, extended as the prefix cache needs them
    # (memory/prefix_cache.py; vLLM keeps them on its Request too). Tokens are only appended,
    # so a hash once computed stays right.
    block_hashes: list[bytes] = field(default_factory=list, repr=False)
    generator: torch.Generator | None = None  # only for requests with their own seed
    # The token ids of `params.bad_words`, as the engine's tokenizer spells them (Engine.add_request).
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)
    # Structured outputs: the request's grammar matcher, once its grammar has compiled
    # (nanoserve/grammar/), and, for a reasoning model still thinking, the token (`</think>`)
    # after which the grammar starts to apply (None: it applies now).
    grammar: GrammarMatcher | None = field(default=None, repr=False)
    grammar_after_token: int | None = None
    # What ended it: a stop string or stop token (the output's text lives in the engine's
    # output processor, output_processor.py).
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    # Per prompt token, {token: logprob} with the top alternatives; None for the first (nothing
    # predicts it). Filled chunk by chunk as the prompt is computed (params.prompt_logprobs).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    first_scheduled_time: float | None = None  # when a step first ran any of it (queue time ends)
    first_token_time: float | None = None
    finished_time: float | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("the prompt must contain at least one token")
        self.priority = RequestClass(self.priority)  # a bad value: "priority must be one of online, offline, ..."
        self.token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_tokens_left(self) -> int:
        """Output tokens `max_tokens` still allows, at least 1: what a length prediction for an
        unfinished request is capped to (the engine stops it there)."""
        return max(1, self.params.max_tokens - self.num_output_tokens)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def grammar_active(self) -> bool:
        """Whether this step's draw is constrained by the request's grammar."""
        return self.grammar is not None and self.grammar_after_token is None

    @property
    def min_tokens_stop_ids(self) -> frozenset[int]:
        """The tokens `params.min_tokens` holds back: EOS (unless ignored) and the stop tokens."""
        eos = frozenset() if self.params.ignore_eos else self.eos_token_ids
        return eos | frozenset(self.params.stop_token_ids or ())

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def truncate_output(self, num_output_tokens: int) -> None:
        """Keep only the first `num_output_tokens` output tokens (and their logprobs): a stop
        string ended the output there after later tokens were computed. Only for a finished
        request, whose KV is already freed."""
        assert self.is_finished
        del self.token_ids[self.num_prompt_tokens + num_output_tokens:]
        if self.logprobs is not None:
            del self.logprobs[num_output_tokens:]

    def append_token(self, token_id: int, now: float) -> None:
        self.token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = now
