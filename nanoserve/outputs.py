"""What the engine hands back to callers: one `RequestOutput` per request per step it advanced.

A step's results are made in two halves, as in vLLM v1. The engine's thread makes an
`EngineCoreOutput` per request, the token-level facts (new token ids, logprobs, whether EOS, a
stop token or the length ended it); the `OutputProcessor` (output_processor.py) turns those into
`RequestOutput`s, the text half (detokenizing, stop strings, the snapshot a caller keeps). A stop
string it finds comes back to the engine as a `StringStop`.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RequestMetrics:
    """Latencies in seconds. tpot is the mean gap between output tokens after the first."""

    arrival_time: float
    ttft: float | None
    tpot: float | None
    e2e: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_preemptions: int = 0
    queue_time: float | None = None  # arrival to first scheduled
    prefill_time: float | None = None  # first scheduled to first token

    @classmethod
    def of(cls, arrival: float, scheduled: float | None, first_token: float | None, finished: float | None,
           num_prompt_tokens: int, num_output_tokens: int, num_preemptions: int) -> RequestMetrics:
        """The latencies of a request from its timestamps (None: not reached yet)."""
        n_out = num_output_tokens
        decoding = None if first_token is None or finished is None or n_out < 2 else finished - first_token
        return cls(
            arrival_time=arrival,
            ttft=None if first_token is None else first_token - arrival,
            tpot=None if decoding is None else decoding / (n_out - 1),
            e2e=None if finished is None else finished - arrival,
            num_prompt_tokens=num_prompt_tokens,
            num_output_tokens=n_out,
            num_preemptions=num_preemptions,
            queue_time=None if scheduled is None else scheduled - arrival,
            prefill_time=None if scheduled is None or first_token is None else first_token - scheduled,
        )


@dataclass(frozen=True, slots=True)
class EngineCoreOutput:
    """What the engine's latest steps did to one request, before any text is made (vLLM v1's
    `EngineCoreOutput`): the tokens and logprobs added since the request's previous core output,
    and its finish if it finished. `time`: when the newest token was appended, or when the
    request finished (the scheduler's clock). The request's timestamps travel raw: the output
    processor, off the engine's thread, makes its `RequestMetrics`."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: int | str | None
    time: float
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None  # all rows so far, when asked for

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class StringStop:
    """A stop string the output processor found: the request ends after its first
    `num_output_tokens` output tokens, the one at `time` completing `stop`. The engine may have
    computed tokens past it meanwhile (outputs made on another thread); it drops them."""

    request_id: str
    num_output_tokens: int
    stop: str
    time: float


@dataclass(frozen=True)
class CompletionOutput:
    """One of a prompt's n completions (vLLM's name and fields)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None
    logprobs: list[dict[int, float]] | None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str  # all text generated so far (stop string excluded)
    token_ids: list[int]  # all generated token ids so far
    finish_reason: str | None  # None while running; "stop" | "length" | "abort"
    logprobs: list[dict[int, float]] | None
    metrics: RequestMetrics
    # What this step added, for streaming. Text may lag tokens while a multi-byte character or
    # a possible stop string is still incomplete.
    new_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    stop_reason: int | str | None = None  # the stop string or stop token that ended it
    # Prompt tokens whose K/V the prefix cache supplied (OpenAI's usage.prompt_tokens_details.cached_tokens)
    num_cached_tokens: int = 0
    # Per prompt token: its logprob and the top alternatives ({token: logprob}); None for the
    # first token, which nothing predicts (vLLM's shape). None unless prompt_logprobs was asked.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # Every completion of the prompt when SamplingParams.n > 1 (`LLM.generate` fills it; the
    # fields above are then the first's); None: this output is the only one.
    choices: list[CompletionOutput] | None = None

    @property
    def outputs(self) -> list[CompletionOutput]:
        """The prompt's completions, as vLLM's `RequestOutput.outputs`: n of them, or this one."""
        if self.choices is not None:
            return self.choices
        return [CompletionOutput(0, self.text, self.token_ids, self.finish_reason, self.stop_reason, self.logprobs)]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
