"""The wire format of requests: pydantic models for what clients send (responses.py has what we
send back).

Requests follow the OpenAI API plus vLLM's extensions (`top_k`, `ignore_eos`, `stop_token_ids`).
Numbers and flags are *strict*: `"ten"`, `true` or `5.0` for `max_tokens` are errors rather
than silently coerced, because a client that sends the wrong type has a bug it wants to hear
about. Every field is nullable, as OpenAI's are, and null means "the default".

Fields nanoserve cannot honour (penalties, logit_bias, echo, tools, ...) are accepted only at
their neutral values; anything else is refused with a message naming the field, instead of
quietly producing output the client did not ask for. Unknown fields are ignored, as vLLM does.
"""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator

from nanoserve.sampling import SamplingParams
from nanoserve.server.errors import APIError
from nanoserve.slo import RequestClass

MAX_N = 16  # choices per prompt; each is its own engine request
MAX_CHOICES = 64  # prompts x n per call, so one call cannot flood the queue
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API's limit
MAX_TOP_LOGPROBS = 20  # the chat API's limit
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")

Temperature = Annotated[StrictFloat, Field(ge=0, allow_inf_nan=False)]
TopP = Annotated[StrictFloat, Field(gt=0, le=1, allow_inf_nan=False)]
Penalty = Annotated[StrictFloat, Field(allow_inf_nan=False)]
Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]
# torch seeds are 64-bit; n > 1 derives seed + i per choice, so stay inside int64.
Seed = Annotated[StrictInt, Field(ge=-(2 ** 63), le=2 ** 63 - 1 - MAX_N)]


class StreamOptions(BaseModel):
    include_usage: StrictBool | None = False


class SLOTargets(BaseModel):
    """nanoserve's per-request latency targets in seconds; a target left out keeps the class's."""

    model_config = ConfigDict(extra="forbid")

    ttft: Seconds | None = None
    tpot: Seconds | None = None


class _SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: StrictInt | None = Field(None, ge=-1)
    n: StrictInt | None = Field(None, ge=1, le=MAX_N)
    seed: Seed | None = None
    stop: list[str] | None = None
    stop_token_ids: list[Annotated[StrictInt, Field(ge=0)]] | None = None
    ignore_eos: StrictBool | None = False
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    # nanoserve's request class (vLLM takes a priority too): clients send "online" or "offline",
    # which pydantic turns into the member (anything else: "Input should be 'online' or 'offline'").
    priority: RequestClass = RequestClass.ONLINE
    slo: SLOTargets | None = None
    timeout: Seconds | None = None  # nanoserve: seconds until the server cuts the request off (408)
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Penalty | None = None
    logit_bias: dict[str, Any] | None = None
    best_of: StrictInt | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> Any:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        return stops

    def check_supported(self) -> None:
        """Refuse options that would change the output in ways nanoserve does not implement."""
        for name, neutral in (("presence_penalty", 0), ("frequency_penalty", 0), ("repetition_penalty", 1)):
            value = getattr(self, name)
            if value is not None and value != neutral:
                raise APIError(f"{name} is not supported by this server (only {neutral} is accepted).", param=name)
        if self.logit_bias:
            raise APIError("logit_bias is not supported by this server.", param="logit_bias")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise APIError("best_of is not supported by this server (it must equal n).", param="best_of")
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed when stream is true.", param="stream_options")

    def sampling_params(self, max_tokens: int, logprobs: int | None, choice: int) -> SamplingParams:
        """Engine parameters for one choice. Choices of a seeded request get seed + index, as in
        vLLM, so that n > 1 returns n different samples that are each reproducible."""
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else float(self.temperature),
                top_p=1.0 if self.top_p is None else float(self.top_p),
                top_k=self.top_k or 0,
                seed=None if self.seed is None else self.seed + choice,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                ignore_eos=bool(self.ignore_eos),
                logprobs=logprobs,
            )
        except ValueError as exc:
            raise APIError(str(exc)) from exc

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


Prompt = str | list[int]


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions. `prompt` is normalised to a list of prompts (text or token ids)."""

    prompt: list[Prompt]
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: StrictBool | None = False
    suffix: StrictStr | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        # One clear message instead of pydantic's per-branch union errors.
        shape = "prompt must be a string, a list of strings, a list of token ids, or a list of token-id lists"

        def is_ids(v: Any) -> bool:
            return isinstance(v, list) and bool(v) and all(type(t) is int for t in v)  # bool is not a token

        prompts: list[Prompt]
        if isinstance(value, str):
            prompts = [value]
        elif not isinstance(value, list):
            raise ValueError(shape)
        elif not value:
            raise ValueError("prompt must not be empty")
        elif is_ids(value):
            prompts = [value]
        elif all(isinstance(p, str) for p in value) or all(is_ids(p) for p in value):
            prompts = value
        else:
            raise ValueError(shape)
        if any(p == "" for p in prompts):
            raise ValueError("prompt must not be empty")
        return prompts

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise APIError("echo is not supported by this server.", param="echo")
        if self.suffix:
            raise APIError("suffix is not supported by this server.", param="suffix")
        n = self.n or 1
        if len(self.prompt) * n > MAX_CHOICES:
            raise APIError(f"Too many choices: {len(self.prompt)} prompts x n={n} exceeds {MAX_CHOICES} "
                           "per request.", param="n" if n > 1 else "prompt")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ... are passed to the template

    role: StrictStr
    content: Any = None  # a string or text parts; the tokenizer checks and explains the shape

    @field_validator("role")
    @classmethod
    def _role(cls, value: str) -> str:
        # A template renders any role it is given, so an unknown one would quietly become a
        # prompt the model was never trained on; OpenAI refuses it, and so do we.
        if value not in CHAT_ROLES:
            raise ValueError(f"unknown role {value!r}; expected one of {', '.join(CHAT_ROLES)}")
        return value


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: StrictBool | None = True  # vLLM extension
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise APIError("tools are not supported by this server.", param="tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise APIError("response_format other than {'type': 'text'} is not supported.",
                           param="response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs requires logprobs to be true.", param="top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        # max_tokens is deprecated in favour of max_completion_tokens; honour either.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat_messages(self) -> list[dict[str, Any]]:
        return [m.model_dump(exclude_none=True) for m in self.messages]
