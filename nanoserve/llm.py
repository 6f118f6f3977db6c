"""The offline API: hand over all prompts, get all completions back, with a progress bar."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from tqdm.auto import tqdm

from nanoserve.builder import build_engine
from nanoserve.config import EngineArgs
from nanoserve.engine import Engine
from nanoserve.outputs import CompletionOutput, RequestOutput
from nanoserve.sampling import SamplingParams
from nanoserve.slo import SLO, RequestClass
from nanoserve.tokenizer import Tokenizer

Prompt = str | list[int]
Message = dict[str, Any]


class LLM:
    """`LLM(model).generate(prompts, params)`, vLLM-style. `model=None` is the embedded SmolLM2.

    Every other keyword is a field of `EngineArgs` (config.py), where each is documented and its
    default written: `LLM(device="cpu", policy="conserve", max_num_seqs=64)`."""

    def __init__(self, model: str | None = None, **engine_args: Any):
        self.engine: Engine = build_engine(EngineArgs(model=model, **engine_args))

    def shutdown(self) -> None:
        """Stop the worker processes of a tensor-parallel engine (a no-op on one device)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's recommended values (its generation_config.json, as
        vLLM's `LLM.get_default_sampling_params`); what `generate` uses when given none."""
        return SamplingParams(**self.engine.sampling_defaults)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (vLLM's `LLM.reset_prefix_cache`); returns the blocks forgotten."""
        return self.engine.reset_prefix_cache()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None, *, use_tqdm: bool = True,
                 priority: RequestClass | str | Sequence[RequestClass | str] = RequestClass.ONLINE,
                 slo: SLO | Sequence[SLO | None] | None = None) -> list[RequestOutput]:
        """Complete each prompt (a string or a list of token ids); outputs come in input order.
        `priority` (a RequestClass, or "online" / "offline") and `slo` (latency targets; default:
        the class's) apply to every prompt, or give one per prompt."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        # Now a sequence of prompts (a list of token ids is one prompt, which types cannot tell).
        prompts = list(cast(Sequence[Prompt], prompts))
        if params is None:
            params = self.get_default_sampling_params()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        priorities = [priority] * len(prompts) if isinstance(priority, str) else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        # Every class is checked before any work: "priority must be one of online, offline, got ...".
        classes = [RequestClass(p) for p in priorities]
        slos = [slo] * len(prompts) if slo is None or isinstance(slo, SLO) else list(slo)
        if len(slos) != len(prompts):
            raise ValueError(f"got {len(slos)} SLOs for {len(prompts)} prompts")
        return self._run(prompts, list(params), classes, slos, use_tqdm)

    def chat(self, messages: list[Message] | Sequence[list[Message]],
             params: SamplingParams | Sequence[SamplingParams] | None = None, *, use_tqdm: bool = True,
             add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Render each conversation with the model's chat template and complete it. `tools` (OpenAI's
        function list) and `chat_template_kwargs` (e.g. Qwen3's enable_thinking) reach the
        template as variables, as in transformers and vLLM."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it cannot chat")
        # A list of messages is one conversation (which types cannot tell from a list of them).
        conversations = cast(list[list[Message]],
                             [messages] if messages and isinstance(messages[0], dict) else list(messages))
        prompts = [self.tokenizer.encode(
                       self.tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt,
                                                          **{**(chat_template_kwargs or {}), "tools": tools}),
                       add_special_tokens=False)
                   for c in conversations]
        return self.generate(prompts, params, use_tqdm=use_tqdm)

    def _run(self, prompts: list[Prompt], params: list[SamplingParams], priorities: list[RequestClass],
             slos: list[SLO | None], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        token_ids = [engine.tokenize(p) for p in prompts]
        for tokens, p in zip(token_ids, params):  # reject the whole call before any work starts
            engine.validate(len(tokens), p)
        ids: list[list[str]] = []  # per prompt, its n requests' ids
        # Only finished requests are returned: the engine need not build an output for every
        # token of every request (a copy of its tokens so far each time: 0.9 -> 0.7 ms of host
        # time a step at 64 requests, benchmarks/RESULTS.md).
        streaming = engine.set_stream_outputs(False)
        try:
            for prompt, tokens, p, priority, slo in zip(prompts, token_ids, params, priorities, slos):
                text = prompt if isinstance(prompt, str) else None
                ids.append([engine.add_request(tokens, choice, prompt_text=text, priority=priority, slo=slo).request_id
                            for choice in self._choices(p)])
            results: dict[str, RequestOutput] = {}
            total = sum(len(i) for i in ids)
            with tqdm(total=total, desc="generate", disable=not use_tqdm, unit="req") as bar:
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.finished:
                            results[out.request_id] = out
                            bar.update(1)
            return [self._merged([results[i] for i in choice_ids]) for choice_ids in ids]
        finally:
            engine.set_stream_outputs(streaming)
            for choice_ids in ids:  # on an exception (or Ctrl-C) leave no request behind
                for request_id in choice_ids:
                    engine.abort_request(request_id)

    @staticmethod
    def _choices(params: SamplingParams) -> list[SamplingParams]:
        """One engine request per completion; a seeded request's i-th gets seed + i, as in vLLM
        and the server, so the n samples differ and each is reproducible."""
        if params.n == 1:
            return [params]
        return [params.replace(n=1, seed=None if params.seed is None else params.seed + i) for i in range(params.n)]

    @staticmethod
    def _merged(outputs: list[RequestOutput]) -> RequestOutput:
        """A prompt's output: its one request's, or the first of n with all n as `choices`."""
        if len(outputs) == 1:
            return outputs[0]
        first = outputs[0]
        first.choices = [CompletionOutput(i, o.text, o.token_ids, o.finish_reason, o.stop_reason, o.logprobs)
                         for i, o in enumerate(outputs)]
        return first
