"""The batched sampler: one row of logits per request in, one token per request out.

It works on the whole batch at once (greedy rows by argmax, random rows by the exponential-race
trick, which is multinomial sampling without a cumulative sum) and only falls back to per-row
work for requests that carry their own seed, so that a seeded request draws the same tokens
whatever else shares its batch.

Logprobs are those of the model's own distribution (log-softmax of the raw logits), as vLLM
and the OpenAI API report them, not of the temperature/top-k/top-p-adjusted one.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from nanoserve.device import to_device
from nanoserve.sampling import SamplingParams


@dataclass
class SampleResult:
    token_ids: list[int]
    # Per row: {token_id: logprob} with the top-n tokens plus the sampled one, or None.
    logprobs: list[dict[int, float] | None]


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and top-p nucleus. top_k == 0: no limit."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
    ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    drop = ranks >= k.unsqueeze(1)
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # A token is dropped when the mass strictly before it already reaches top_p; the first token
    # is always kept, so no row is left empty.
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p.unsqueeze(1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


@dataclass
class DrawsOnDevice:
    """A batch's draws as `sample_on_device` left them: queued on the device, their copy to the
    host already started. `tokens` stays on the device, where the next step may read its inputs
    (asynchronous scheduling); `result()` waits for the copy, and only for it: a step launched
    after this one keeps running (a `.tolist()` then would wait for that step too)."""

    tokens: torch.Tensor  # [rows] int64, on the logits' device
    params: list[SamplingParams]
    host_tokens: torch.Tensor
    logprob_rows: list[int]  # rows that asked for logprobs
    host_logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # chosen, top values, top ids
    ready: torch.cuda.Event | None  # recorded after the copies (None on a CPU: they are done)

    def result(self) -> SampleResult:
        if self.ready is not None:
            self.ready.synchronize()
        token_list = self.host_tokens.tolist()
        logprob_rows: list[dict[int, float] | None] = [None] * len(token_list)
        if self.host_logprobs is not None:
            chosen, top_vals, top_ids = (t.tolist() for t in self.host_logprobs)
            for j, i in enumerate(self.logprob_rows):
                m = self.params[i].logprobs or 0
                row = dict(zip(top_ids[j][:m], top_vals[j][:m]))
                row[token_list[i]] = chosen[j]
                logprob_rows[i] = row
        return SampleResult(token_list, logprob_rows)


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """Start copying a device tensor into page-locked host memory (returns it at once)."""
    if tensor.device.type == "cpu":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator,
) -> SampleResult:
    """Sample one token per row. `generators[i]` is row i's own generator (seeded requests)."""
    return sample_on_device(logits, params, generators, default_generator).result()


def sample_on_device(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator,
) -> DrawsOnDevice:
    """`sample` without waiting: the draws are queued on the logits' device."""
    # Greedy rows take the argmax in the logits' own dtype (widening to fp32 keeps every value and
    # so the first maximum); only the rows that draw or report logprobs are widened, so a greedy
    # batch skips a copy of its logits twice their size.
    tokens = logits.argmax(dim=-1)
    device = logits.device

    on_device = partial(to_device, device=device)

    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        idx = on_device(random_rows)
        rows = logits[idx].float() / on_device([params[i].temperature for i in random_rows], torch.float32).unsqueeze(1)
        if any(params[i].effective_top_k or params[i].top_p < 1 for i in random_rows):
            top_k = on_device([params[i].effective_top_k for i in random_rows])
            top_p = on_device([params[i].top_p for i in random_rows], torch.float32)
            rows = _apply_top_k_top_p(rows, top_k, top_p)
        probs = rows.softmax(dim=-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p. Seeded rows get their
        # noise from their own generator so their draws do not depend on the batch.
        noise = torch.empty_like(probs)
        unseeded = [j for j, i in enumerate(random_rows) if generators[i] is None]
        if unseeded:
            noise[on_device(unseeded)] = torch.empty(len(unseeded), probs.shape[1], device=device).exponential_(
                generator=default_generator)
        for j, i in enumerate(random_rows):
            if generators[i] is not None:
                noise[j].exponential_(generator=generators[i])
        tokens[idx] = (probs / noise).argmax(dim=-1)

    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    host_logprobs = None
    if wanted:
        idx = on_device(wanted)
        logprobs = logits[idx].float().log_softmax(dim=-1)
        k = max(params[i].logprobs or 0 for i in wanted)
        top_vals, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
        chosen = logprobs.gather(1, tokens[idx].unsqueeze(1)).squeeze(1)
        host_logprobs = (_to_host(chosen), _to_host(top_vals), _to_host(top_ids))
    host_tokens = _to_host(tokens)
    ready = None
    if tokens.device.type == "cuda":
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(tokens.device))
    return DrawsOnDevice(tokens, params, host_tokens, wanted, host_logprobs, ready)
