"""The text half of a step: token ids to the `RequestOutput`s a caller reads (vLLM v1's
`OutputProcessor`).

    engine thread   step_core() ─► [EngineCoreOutput ...]      token ids, logprobs, EOS/length
                                          │
    this module     process() ─► detokenize, find stop strings, build RequestOutputs
                                          │
                                          └─► [StringStop ...] back to the engine: end these

The engine makes the core outputs; whoever drives it runs `process`, on the engine's own thread
(`Engine.step` does, and `LLM.generate`, the simulator and a cluster's members use that) or on a
thread of its own (the server's `AsyncEngine` with `output_thread`). Off the engine's thread,
detokenizing and building a snapshot per request per step (about 10 us each; 0.6 ms of a step of
64 on our CPU) run while the engine schedules and launches the next step, or waits for the
device, instead of in series with them. vLLM v1 goes further and runs this in another process.

A stop string is text, so only this half can find it. Found on the engine's thread, the request
ends at that token, as before the split. Found on another thread, the engine may have computed a
token or two past it meanwhile; the `StringStop` says where the output ends, the engine drops
what came after (`Engine.stop_request`), and the caller never sees those tokens. vLLM v1 has the
same lag and the same remedy.

Thread safety: `add_request` runs on the engine's thread when a request arrives; from then on
only the thread that calls `process` touches the request's state. The queue that carries core
outputs from the one thread to the other orders the two.
"""
from __future__ import annotations

from collections.abc import Sequence

from nanoserve.outputs import EngineCoreOutput, RequestMetrics, RequestOutput, StringStop
from nanoserve.sampling import SamplingParams
from nanoserve.tokenizer import IncrementalDetokenizer, Tokenizer


class RequestText:
    """One request's output so far, as its caller sees it: tokens, text, logprobs, and how much
    of the text has been handed out."""

    __slots__ = ("request_id", "prompt", "prompt_token_ids", "params", "detokenizer", "token_ids", "text",
                 "emitted", "logprobs", "prompt_logprobs")

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 detokenizer: IncrementalDetokenizer | None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.detokenizer = detokenizer
        self.token_ids: list[int] = []
        self.text = ""
        self.emitted = 0  # characters of `text` already handed out
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[dict[int, float] | None] | None = None

    def append(self, core: EngineCoreOutput) -> str | None:
        """Take the core output's tokens; return the stop string one of them completed (the
        tokens after it are not taken), or None. The engine reports a request with stop
        strings after every token, so that token is the core output's last one or `time` is
        its time."""
        params = self.params
        for i, token in enumerate(core.new_token_ids):
            self.token_ids.append(token)
            if self.logprobs is not None and core.new_logprobs is not None:
                self.logprobs.append(core.new_logprobs[i])
            if self.detokenizer is None:
                continue
            before = len(self.detokenizer.text)
            self.detokenizer.append(token)
            text = self.detokenizer.text
            # vLLM's min_tokens: no stop string before it. A stop string this token completed
            # must end in the new text: search only there.
            if len(self.token_ids) >= params.min_tokens:
                for stop in params.stop_strings:
                    at = text.find(stop, max(0, before - len(stop) + 1))
                    if at >= 0:
                        self.text = text[:at + len(stop) if params.include_stop_str_in_output else at]
                        return stop
            self.text = text
        return None

    def output(self, core: EngineCoreOutput, new_tokens: int, finish_reason: str | None,
               stop_reason: int | str | None) -> RequestOutput:
        """The caller's snapshot after `core`: everything so far, and what this step added."""
        # While a stop string may still be forming, hold back the characters that could begin it.
        finished = finish_reason is not None
        metrics = RequestMetrics.of(core.arrival_time, core.first_scheduled_time, core.first_token_time,
                                    core.time if finished else None, len(self.prompt_token_ids),
                                    len(self.token_ids), core.num_preemptions)
        hold = 0 if finished else max((len(s) - 1 for s in self.params.stop_strings), default=0)
        visible = len(self.text) - hold
        start = self.emitted
        new_text = self.text[start:visible] if visible > start else ""
        self.emitted = max(start, visible)
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            text=self.text,
            token_ids=list(self.token_ids),
            finish_reason=finish_reason,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            metrics=metrics,
            new_text=new_text,
            new_token_ids=self.token_ids[len(self.token_ids) - new_tokens:] if new_tokens else [],
            stop_reason=stop_reason,
            num_cached_tokens=core.num_cached_tokens,
            prompt_logprobs=list(self.prompt_logprobs) if self.prompt_logprobs is not None else None,
        )


class OutputProcessor:
    """Makes the `RequestOutput`s of the requests it was told of (`add_request`) from their core
    outputs. `stream`: an output for every core output (a server's streams), or only for the
    finished (`LLM.generate`, the simulator)."""

    def __init__(self, tokenizer: Tokenizer | None, stream: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stream = stream
        self._requests: dict[str, RequestText] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        detokenizer = (IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
                       if self.tokenizer is not None else None)
        self._requests[request_id] = RequestText(request_id, prompt, prompt_token_ids, params, detokenizer)

    def detach(self, request_id: str) -> RequestText | None:
        """Hand a request's output state over with the request (`Engine.detach_request`)."""
        return self._requests.pop(request_id, None)

    def attach(self, state: RequestText) -> None:
        self._requests[state.request_id] = state

    def forget(self, request_id: str) -> None:
        """Drop the state of a request whose outputs nobody will ask for (it failed)."""
        self._requests.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._requests)

    def process(self, outputs: Sequence[EngineCoreOutput]) -> tuple[list[RequestOutput], list[StringStop]]:
        """The callers' outputs for a step's core outputs, and the stop strings found. A core
        output of a request already ended here (by a stop string, on another thread) is dropped."""
        made: list[RequestOutput] = []
        stops: list[StringStop] = []
        for core in outputs:
            state = self._requests.get(core.request_id)
            if state is None:
                continue
            if core.prompt_logprobs is not None:  # the request's first core output carries them
                state.prompt_logprobs = core.prompt_logprobs
            have = len(state.token_ids)
            stop = state.append(core)
            finish_reason, stop_reason = core.finish_reason, core.stop_reason
            if stop is not None:
                # The output ends at the token that completed the stop string (`append` took
                # none after it), at that token's time, whatever the engine decided about it.
                finish_reason, stop_reason = "stop", stop
                stops.append(StringStop(core.request_id, len(state.token_ids), stop, core.time))
            if finish_reason is not None:
                del self._requests[core.request_id]
            if self.stream or finish_reason is not None:
                made.append(state.output(core, len(state.token_ids) - have, finish_reason, stop_reason))
        return made, stops

