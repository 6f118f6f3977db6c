"""The wire format of requests: pydantic models for what clients send (responses.py has what we
send back).

Requests follow the OpenAI API plus vLLM's extensions (`top_k`, `ignore_eos`, `stop_token_ids`).
Numbers and flags are *strict*: `"ten"`, `true` or `5.0` for `max_tokens` are errors rather
than silently coerced, because a client that sends the wrong type has a bug it wants to hear
about. Every field is nullable, as OpenAI's are, and null means "the default".

Fields nanoserve cannot honour (best_of, beam search, audio, ...) are accepted only at their
neutral values; anything else is refused with a message naming the field, instead of quietly
producing output the client did not ask for. Fields no model here declares are sorted by
`request_fields.py`: accepted where they change nothing, refused where they would, logged once
where neither schema knows them.
"""
from __future__ import annotations

from collections.abc import Mapping
from functools import cached_property
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator

from nanoserve.sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams
from nanoserve.server.errors import APIError
from nanoserve.server.request_fields import check_extra_fields
from nanoserve.server.tool_calls import tool_choice_grammar, validate_tools
from nanoserve.slo import RequestClass
from nanoserve.structured_outputs import StructuredOutputsParams

MAX_N = 16  # choices per prompt; each is its own engine request
MAX_CHOICES = 64  # prompts x n per call, so one call cannot flood the queue
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API's limit
MAX_TOP_LOGPROBS = 20  # the chat API's limit
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")

Temperature = Annotated[StrictFloat, Field(ge=0, allow_inf_nan=False)]
TopP = Annotated[StrictFloat, Field(gt=0, le=1, allow_inf_nan=False)]
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


class StructuredOutputsBody(BaseModel):
    """vLLM's `structured_outputs` request field: set one of json, regex, choice, grammar,
    json_object (checked by `StructuredOutputsParams`, the schema or regex by the backend)."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | StrictStr | None = Field(None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None
    # vLLM's options that nanoserve's backend does not take: refused unless neutral.
    disable_fallback: StrictBool | None = None
    disable_any_whitespace: StrictBool | None = None
    disable_additional_properties: StrictBool | None = None
    whitespace_pattern: StrictStr | None = None
    structural_tag: StrictStr | None = None

    def params(self) -> StructuredOutputsParams:
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if getattr(self, name):
                raise APIError(f"structured_outputs.{name} is not supported by this server.",
                               param=f"structured_outputs.{name}")
        for name in ("whitespace_pattern", "structural_tag"):
            if getattr(self, name) is not None:
                raise APIError(f"structured_outputs.{name} is not supported by this server.",
                               param=f"structured_outputs.{name}")
        try:
            return StructuredOutputsParams(json=self.json_, regex=self.regex, choice=self.choice,
                                           grammar=self.grammar, json_object=bool(self.json_object))
        except ValueError as exc:
            raise APIError(str(exc), param="structured_outputs") from exc


class JSONSchemaFormat(BaseModel):
    """response_format's `json_schema` (OpenAI): a named schema the output must match."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: StrictStr
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None  # the output always follows the schema here, strict or not


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, json_object, or json_schema."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    def constraint(self) -> StructuredOutputsParams | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.json_schema is None:
            raise APIError("response_format of type json_schema needs a json_schema object.",
                           param="response_format.json_schema")
        return StructuredOutputsParams(json=self.json_schema.schema_ or {})


UnitFloat = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
OpenAIPenalty = Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)]
Bias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS, allow_inf_nan=False)]
TokenId = Annotated[StrictInt, Field(ge=0)]


class _SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions. A field the model does not
    declare goes to `request_fields.check_extra_fields` (accepted, refused or logged)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: StrictInt | None = Field(None, ge=-1)
    min_p: UnitFloat | None = None
    n: StrictInt | None = Field(None, ge=1, le=MAX_N)
    seed: Seed | None = None
    stop: list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: StrictBool | None = None
    ignore_eos: StrictBool | None = False
    min_tokens: StrictInt | None = Field(None, ge=0)
    presence_penalty: OpenAIPenalty | None = None
    frequency_penalty: OpenAIPenalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    logit_bias: dict[str, Bias] | None = None
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[StrictStr] | None = None
    skip_special_tokens: StrictBool | None = None
    prompt_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    structured_outputs: StructuredOutputsBody | None = None
    response_format: ResponseFormat | None = None  # OpenAI's; vLLM takes it for completions too
    # vLLM's older names for structured outputs, still sent by many clients.
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    # nanoserve's request class (vLLM takes a priority too): clients send "online" or "offline",
    # which pydantic turns into the member (anything else: "Input should be 'online' or 'offline'").
    priority: RequestClass = RequestClass.ONLINE
    slo: SLOTargets | None = None
    timeout: Seconds | None = None  # nanoserve: seconds until the server cuts the request off (408)
    best_of: StrictInt | None = None
    use_beam_search: StrictBool | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> Any:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        # OpenAI's keys are token ids written as strings: {"50256": -100}.
        for key in value or {}:
            if not key.isdigit():
                raise ValueError(f"keys must be token ids (strings of digits), got {key!r}")
        return value

    def check_supported(self) -> None:
        """Refuse options that would change the output in ways nanoserve does not implement."""
        check_extra_fields(self.model_extra)
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise APIError("best_of is not supported by this server (it must equal n).", param="best_of")
        if self.use_beam_search:
            raise APIError("use_beam_search is not supported by this server.", param="use_beam_search")
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed when stream is true.", param="stream_options")
        self.output_constraint  # noqa: B018  (built here: a malformed constraint is a 400 before any work)

    @cached_property
    def output_constraint(self) -> StructuredOutputsParams | None:
        """The request's one output constraint, from whichever field carries it (built once: every
        choice of the request shares it)."""
        given: dict[str, StructuredOutputsParams] = {}
        if self.structured_outputs is not None:
            given["structured_outputs"] = self.structured_outputs.params()
        guided: dict[str, Any] = {"json": self.guided_json, "regex": self.guided_regex,
                                  "choice": self.guided_choice, "grammar": self.guided_grammar}
        for kind, value in guided.items():
            if value is not None:
                try:
                    given[f"guided_{kind}"] = StructuredOutputsParams(**{kind: value})
                except ValueError as exc:
                    raise APIError(str(exc), param=f"guided_{kind}") from exc
        given.update(self._format_constraint())
        if len(given) > 1:
            raise APIError(f"Only one output constraint may be given, got {', '.join(sorted(given))}.",
                           param=sorted(given)[1])
        return next(iter(given.values()), None)

    def _format_constraint(self) -> dict[str, StructuredOutputsParams]:
        """The constraints the request's format fields ask for (response_format; chat's tool_choice)."""
        try:
            constraint = self.response_format.constraint() if self.response_format is not None else None
        except ValueError as exc:
            raise APIError(str(exc), param="response_format") from exc
        return {} if constraint is None else {"response_format": constraint}

    def sampling_params(self, max_tokens: int, logprobs: int | None, choice: int,
                        defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """Engine parameters for one choice. Choices of a seeded request get seed + index, as in
        vLLM, so that n > 1 returns n different samples that are each reproducible. A field the
        request leaves out takes `defaults` (the model's generation_config.json, as vLLM's
        `--generation-config auto`), then SamplingParams' own default."""
        given = {name: getattr(self, name) for name in DEFAULTABLE if getattr(self, name) is not None}
        values = {**{k: v for k, v in (defaults or {}).items() if k in DEFAULTABLE}, **given}
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                seed=None if self.seed is None else self.seed + choice,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                ignore_eos=bool(self.ignore_eos),
                logprobs=logprobs,
                logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
                allowed_token_ids=self.allowed_token_ids,
                bad_words=self.bad_words or None,
                min_tokens=self.min_tokens or 0,
                include_stop_str_in_output=bool(self.include_stop_str_in_output),
                skip_special_tokens=self.skip_special_tokens is not False,
                prompt_logprobs=self.prompt_logprobs,
                structured_outputs=self.output_constraint,
                **values,
            )
        except ValueError as exc:
            raise APIError(str(exc)) from exc

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


# The sampling fields a model's generation_config.json may give defaults for (vLLM's list).
DEFAULTABLE = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
               "frequency_penalty")


Prompt = str | list[int]


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions. `prompt` is normalised to a list of prompts (text or token ids)."""

    prompt: list[Prompt]
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: StrictBool | None = False
    suffix: StrictStr | None = None
    add_special_tokens: StrictBool | None = True  # vLLM: what the tokenizer adds (BOS, ...) to a text prompt

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

    def sampling_params(self, max_tokens: int, logprobs: int | None, choice: int,
                        defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        params = super().sampling_params(max_tokens, logprobs, choice, defaults)
        if self.echo and logprobs is not None and (params.prompt_logprobs or 0) < logprobs:
            params = params.replace(prompt_logprobs=logprobs)  # echo's logprobs cover the prompt
        return params

    def check_supported(self) -> None:
        super().check_supported()
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
    add_special_tokens: StrictBool | None = False  # vLLM: the template writes BOS itself
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    # Variables for the chat template (vLLM): Qwen3's enable_thinking, ...
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None  # passed to the template (RAG templates)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    echo: StrictBool | None = None

    def check_supported(self) -> None:
        try:
            validate_tools(self.tools, self.tool_choice, self.parallel_tool_calls)
        except ValueError as exc:
            raise APIError(str(exc), param="tool_choice" if str(exc).startswith("tool_choice") else "tools") from exc
        super().check_supported()
        if self.echo:
            raise APIError("echo is not supported in chat completions by this server.", param="echo")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs requires logprobs to be true.", param="top_logprobs")

    def _format_constraint(self) -> dict[str, StructuredOutputsParams]:
        found = super()._format_constraint()
        # tool_choice "required" or a named function: a grammar that only lets the model call one.
        grammar = tool_choice_grammar(self.tools, self.tool_choice, self.parallel_tool_calls) if self.tools else None
        if grammar is not None:
            found["tool_choice"] = StructuredOutputsParams(grammar=grammar)
        return found

    @property
    def parsed_tools(self) -> list[dict[str, Any]] | None:
        """The tools whose calls are parsed out of the text: all of them unless tool_choice is
        "none" (then the text is all content, as OpenAI's is)."""
        return self.tools if self.tools and self.tool_choice != "none" else None

    def template_variables(self) -> dict[str, Any]:
        """What the chat template is rendered with besides the messages (transformers' names)."""
        return template_variables(self.chat_template_kwargs, tools=self.tools, documents=self.documents,
                                  reasoning_effort=self.reasoning_effort)

    @property
    def requested_max_tokens(self) -> int | None:
        # max_tokens is deprecated in favour of max_completion_tokens; honour either.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat_messages(self) -> list[dict[str, Any]]:
        return chat_messages(self.messages)


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the chat template takes them (fields left out, not None)."""
    return [m.model_dump(exclude_none=True) for m in messages]


def template_variables(chat_template_kwargs: dict[str, Any] | None, **named: Any) -> dict[str, Any]:
    """The chat template's variables: the client's `chat_template_kwargs`, then each named field
    it did not set itself (None: left out)."""
    variables: dict[str, Any] = dict(chat_template_kwargs or {})
    for name, value in named.items():
        if value is not None:
            variables.setdefault(name, value)
    return variables


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's): a `prompt`, or chat `messages` rendered by the chat template."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: StrictBool | None = True
    continue_final_message: StrictBool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: StrictBool | None = False

    def template_variables(self) -> dict[str, Any]:
        return template_variables(self.chat_template_kwargs, tools=self.tools)

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError("Give exactly one of prompt and messages.", param="prompt" if self.prompt else "messages")
        if self.continue_final_message:
            raise APIError("continue_final_message is not supported by this server.", param="continue_final_message")


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's): token ids back to text."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    tokens: list[TokenId]
