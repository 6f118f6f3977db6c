"""The offline API: hand over all prompts, get all completions back, with a progress bar."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from tqdm.auto import tqdm

from nanoserve.builder import build_engine
from nanoserve.config import EngineArgs
from nanoserve.engine import Engine
from nanoserve.outputs import RequestOutput
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
            params = SamplingParams()
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
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Render each conversation with the model's chat template and complete it."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it cannot chat")
        # A list of messages is one conversation (which types cannot tell from a list of them).
        conversations = cast(list[list[Message]],
                             [messages] if messages and isinstance(messages[0], dict) else list(messages))
        prompts = [self.tokenizer.encode(
                       self.tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt),
                       add_special_tokens=False)
                   for c in conversations]
        return self.generate(prompts, params, use_tqdm=use_tqdm)

    def _run(self, prompts: list[Prompt], params: list[SamplingParams], priorities: list[RequestClass],
             slos: list[SLO | None], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        token_ids = [engine.tokenize(p) for p in prompts]
        for tokens, p in zip(token_ids, params):  # reject the whole call before any work starts
            engine.validate(len(tokens), p)
        ids: list[str] = []
        # Only finished requests are returned: the engine need not build an output for every
        # token of every request (a copy of its tokens so far each time: 0.9 -> 0.7 ms of host
        # time a step at 64 requests, benchmarks/RESULTS.md).
        streaming = engine.set_stream_outputs(False)
        try:
            for prompt, tokens, p, priority, slo in zip(prompts, token_ids, params, priorities, slos):
                text = prompt if isinstance(prompt, str) else None
                ids.append(engine.add_request(tokens, p, prompt_text=text, priority=priority, slo=slo).request_id)
            results: dict[str, RequestOutput] = {}
            with tqdm(total=len(ids), desc="generate", disable=not use_tqdm, unit="req") as bar:
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.finished:
                            results[out.request_id] = out
                            bar.update(1)
            return [results[i] for i in ids]
        finally:
            engine.set_stream_outputs(streaming)
            for request_id in ids:  # on an exception (or Ctrl-C) leave no request behind
                engine.abort_request(request_id)
