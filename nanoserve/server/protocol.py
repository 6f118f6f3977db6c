"""The wire format: pydantic models for what clients send, and the JSON bodies and SSE chunks we
send back.

Requests follow the OpenAI API plus vLLM's extensions (`top_k`, `ignore_eos`, `stop_token_ids`).
Numbers and flags are *strict*: `"ten"`, `true` or `5.0` for `max_tokens` are errors rather
than silently coerced, because a client that sends the wrong type has a bug it wants to hear
about. Every field is nullable, as OpenAI's are, and null means "the default".

Fields nanoserve cannot honour (penalties, logit_bias, echo, tools, ...) are accepted only at
their neutral values; anything else is refused with a message naming the field, instead of
quietly producing output the client did not ask for. Unknown fields are ignored, as vLLM does.
"""
from __future__ import annotations

import json
import time
from typing import Annotated, Any, AsyncIterator, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator

from nanoserve.outputs import RequestOutput
from nanoserve.sampling import SamplingParams
from nanoserve.server.errors import APIError

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
    priority: Literal["online", "offline"] = "online"  # nanoserve's request class (vLLM takes a priority too)
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


# -- responses ------------------------------------------------------------------------------
# Outputs arrive as (choice index, RequestOutput). A RequestOutput's `logprobs` list may be the
# engine's live list, so it is always cut to the length of the `token_ids` snapshot beside it.

Outputs = AsyncIterator[tuple[int, RequestOutput]]


def now() -> int:
    return int(time.time())


def sse(payload: Any) -> str:
    """One server-sent event, framed as OpenAI sends them."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class IdTokenizer:
    """Stand-in for models served without a tokenizer: logprobs name tokens by id (as vLLM)."""

    def token_to_str(self, token_id: int) -> str:
        return f"token_id:{token_id}"

    def token_bytes(self, token_id: int) -> bytes:
        return self.token_to_str(token_id).encode()


def completion_logprobs(tokenizer: Any, token_ids: list[int], rows: list[dict[int, float]],
                        text_offset: int) -> dict[str, Any]:
    """The legacy completions shape: parallel lists, one entry per generated token.
    `text_offset` is where the first token's text starts in the choice's text (for streaming)."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, row in zip(token_ids, rows):
        text = tokenizer.token_to_str(token_id)
        tokens.append(text)
        token_logprobs.append(row[token_id])
        alternatives: dict[str, float] = {}
        for alt_id, lp in sorted(row.items(), key=lambda kv: -kv[1]):
            alternatives.setdefault(tokenizer.token_to_str(alt_id), lp)  # keep the best of same-text ids
        top.append(alternatives)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(tokenizer: Any, token_ids: list[int], rows: list[dict[int, float]],
                  top_n: int) -> list[dict[str, Any]]:
    """The chat shape: `content` entries with the sampled token and exactly `top_n` alternatives.
    The engine's row holds the top-n plus the sampled token, which may rank below them."""
    def entry(token_id: int, lp: float) -> dict[str, Any]:
        return {"token": tokenizer.token_to_str(token_id), "logprob": lp,
                "bytes": list(tokenizer.token_bytes(token_id))}

    content = []
    for token_id, row in zip(token_ids, rows):
        best = sorted(row.items(), key=lambda kv: -kv[1])[:top_n]
        content.append({**entry(token_id, row[token_id]), "top_logprobs": [entry(t, lp) for t, lp in best]})
    return content


def completion_response(head: dict, finals: list[RequestOutput], tokenizer: Any, logprobs: int | None,
                        prompt_tokens: int) -> dict[str, Any]:
    return {**head, "choices": [{
        "index": i, "text": out.text, "finish_reason": out.finish_reason, "stop_reason": out.stop_reason,
        "logprobs": None if logprobs is None else completion_logprobs(
            tokenizer, out.token_ids, out.logprobs[:len(out.token_ids)], 0),
    } for i, out in enumerate(finals)], "usage": usage(prompt_tokens, sum(len(o.token_ids) for o in finals))}


def chat_response(head: dict, finals: list[RequestOutput], tokenizer: Any, top_n: int | None,
                  prompt_tokens: int) -> dict[str, Any]:
    return {**head, "choices": [{
        "index": i, "message": {"role": "assistant", "content": out.text},
        "finish_reason": out.finish_reason, "stop_reason": out.stop_reason,
        "logprobs": None if top_n is None else {"content": chat_logprobs(
            tokenizer, out.token_ids, out.logprobs[:len(out.token_ids)], top_n)},
    } for i, out in enumerate(finals)], "usage": usage(prompt_tokens, sum(len(o.token_ids) for o in finals))}


async def completion_events(outputs: Outputs, *, head: dict, n: int, tokenizer: Any, logprobs: int | None,
                            include_usage: bool, prompt_tokens: int) -> AsyncIterator[str]:
    """Stream chunks for /v1/completions: text deltas, the finish reason on a choice's last one."""
    extra = {"usage": None} if include_usage else {}
    sent = [0] * n  # tokens already reported, per choice
    offset = [0] * n  # text_offset of the next token, per choice
    completion_tokens = 0
    async for i, out in outputs:
        new_ids = out.token_ids[sent[i]:]
        if not out.new_text and not out.finished and (logprobs is None or not new_ids):
            continue  # text held back (half a character, a possible stop string): nothing to say
        lp = None
        if logprobs is not None:
            lp = completion_logprobs(tokenizer, new_ids, out.logprobs[sent[i]:len(out.token_ids)], offset[i])
            offset[i] += sum(len(t) for t in lp["tokens"])
        sent[i] = len(out.token_ids)
        if out.finished:
            completion_tokens += len(out.token_ids)
        yield sse({**head, "choices": [{"index": i, "text": out.new_text, "logprobs": lp,
                                        "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}],
                   **extra})
    if include_usage:
        yield sse({**head, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})


async def chat_events(outputs: Outputs, *, head: dict, n: int, tokenizer: Any, top_n: int | None,
                      include_usage: bool, prompt_tokens: int) -> AsyncIterator[str]:
    """Stream chunks for /v1/chat/completions, as OpenAI orders them: a `role` delta per choice,
    content deltas, then a chunk with an empty delta and the finish reason."""
    extra = {"usage": None} if include_usage else {}

    def chunk(i: int, delta: dict, finish: str | None = None, logprobs: Any = None, **more: Any) -> str:
        return sse({**head, "choices": [{"index": i, "delta": delta, "logprobs": logprobs,
                                         "finish_reason": finish, **more}], **extra})

    for i in range(n):
        yield chunk(i, {"role": "assistant", "content": ""})
    sent = [0] * n
    completion_tokens = 0
    async for i, out in outputs:
        new_ids = out.token_ids[sent[i]:]
        lp = None
        if top_n is not None and new_ids:
            lp = {"content": chat_logprobs(tokenizer, new_ids, out.logprobs[sent[i]:len(out.token_ids)], top_n)}
        sent[i] = len(out.token_ids)
        if out.new_text or lp is not None:
            yield chunk(i, {"content": out.new_text}, logprobs=lp)
        if out.finished:
            completion_tokens += len(out.token_ids)
            yield chunk(i, {}, out.finish_reason, stop_reason=out.stop_reason)
    if include_usage:
        yield sse({**head, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
