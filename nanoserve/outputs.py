"""What the engine hands back to callers: one `RequestOutput` per request per step it advanced."""
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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
