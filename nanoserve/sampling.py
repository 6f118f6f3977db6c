"""A request's sampling parameters (vLLM's `SamplingParams` and the OpenAI API's), checked when
they are made. The sampler that applies them to a batch of logits is `nanoserve/model/sampler.py`;
the logits processors it runs are in `nanoserve/model/logits_processors.py`.

What each parameter does to a row of logits, in the order the sampler applies them (vLLM v1's):

    allowed_token_ids, bad_words, min_tokens, logit_bias, structured_outputs   masks and biases
    repetition_penalty, frequency_penalty, presence_penalty                   penalties
    temperature = 0  -> argmax of what is left (greedy)
    temperature      -> min_p -> top_k / top_p -> draw                          warpers

Logprobs (`logprobs`, `prompt_logprobs`) are those of the model's own distribution, before any of
this, as vLLM and the OpenAI API report them.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from nanoserve.structured_outputs import StructuredOutputsParams

MAX_LOGPROBS = 20  # the OpenAI API's limit for top_logprobs
MAX_LOGIT_BIAS = 100.0  # OpenAI: "values between -100 and 100"
MAX_N = 16  # choices per prompt


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) means the whole vocabulary
    # vLLM's and HF's min_p: drop tokens less likely than min_p times the most likely one
    # (after temperature). 0 disables it.
    min_p: float = 0.0
    # OpenAI's penalties (their API reference): logit[t] -= count[t] * frequency_penalty
    # + (count[t] > 0) * presence_penalty, counting t in the generated tokens only.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # The CTRL paper's (HF's, vLLM's): a token already in the prompt or the output has its logit
    # divided by the penalty if positive, multiplied if negative. 1 disables it.
    repetition_penalty: float = 1.0
    # Added to the logits of these token ids before sampling (OpenAI's logit_bias: -100 bans a
    # token, 100 makes it the only choice in practice).
    logit_bias: Mapping[int, float] | None = None
    # Only these token ids may be drawn (vLLM's allowed_token_ids).
    allowed_token_ids: Sequence[int] | None = None
    # Words that must not be generated: a word's last token is banned whenever the output ends
    # in the tokens before it (vLLM's bad_words; each word is tokenized with and without a
    # leading space, HF's NoBadWordsLogitsProcessor does the banning).
    bad_words: Sequence[str] | None = None
    # No stop (EOS, stop_token_ids or stop strings) before this many output tokens.
    min_tokens: int = 0
    seed: int | None = None
    stop: str | list[str] | tuple[str, ...] | None = None
    stop_token_ids: list[int] | tuple[int, ...] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives per generated token
    # Per prompt token, its logprob and this many alternatives (the first has none: None).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True  # in the output text (token ids are always all there)
    # Completions per prompt in the offline API (`LLM.generate`); the server fans n out itself.
    n: int = 1
    structured_outputs: StructuredOutputsParams | None = None
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # Each message names the field and the accepted range; the server forwards it verbatim.
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.seed is not None and (not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**63):
            raise ValueError(f"seed must be a 64-bit signed integer, got {self.seed!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if self.logit_bias is not None:
            bias = {}
            for token, value in self.logit_bias.items():
                if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                    raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
                if not math.isfinite(value) or abs(value) > MAX_LOGIT_BIAS:
                    raise ValueError(f"logit_bias values must be in [-100, 100], got {value} for token {token}")
                bias[token] = float(value)
            object.__setattr__(self, "logit_bias", _FrozenDict(bias) if bias else None)
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids or any(not isinstance(t, int) or t < 0 for t in self.allowed_token_ids):
                raise ValueError("allowed_token_ids must be a non-empty list of token ids (integers >= 0)")
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        if self.bad_words is not None:
            if any(not isinstance(w, str) or not w for w in self.bad_words):
                raise ValueError("bad_words must be a list of non-empty strings")
            object.__setattr__(self, "bad_words", tuple(self.bad_words) or None)
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.prompt_logprobs}")
        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        object.__setattr__(self, "stop_strings", stop)
        if self.stop_token_ids is not None:
            if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
                raise ValueError("stop_token_ids must be a list of non-negative integers")
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def effective_top_k(self) -> int:
        return 0 if self.top_k in (0, -1) else self.top_k

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def needs_logits_processing(self) -> bool:
        """Whether anything but temperature/top-k/top-p/min_p touches this request's logits (the
        sampler's rows without it pay nothing for the others')."""
        return (self.has_penalties or self.logit_bias is not None or self.allowed_token_ids is not None
                or self.bad_words is not None or self.min_tokens > 0 or self.structured_outputs is not None)

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with `changes` (the dataclass's `replace`, which would trip on `stop_strings`)."""
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        return SamplingParams(**{**values, **changes})


class _FrozenDict(dict):
    """logit_bias as given, but hashable and read-only, like the rest of a frozen SamplingParams."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items())))

    def _readonly(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("SamplingParams.logit_bias is read-only")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _readonly  # type: ignore[assignment]
