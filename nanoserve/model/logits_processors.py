"""The logits processors: what a request's sampling parameters do to its row of logits before a
token is drawn, each applied to all the rows that ask for it at once.

The sampler (`sampler.py`) gathers the rows that need any of this into one float32 block, calls
`process_rows`, and draws from the result; rows that ask for none of it are never copied (a
greedy batch with one penalized request pays for one row, not the batch). Each processor below
quotes the definition it implements; the tests check each against its oracle
(`transformers.generation.logits_process`, OpenAI's formula).

Per request the processors read a `RowHistory`: the tokens generated so far, the prompt (for the
repetition penalty), the stop tokens min_tokens holds back, and the token ids of its bad words.
Under asynchronous scheduling a request's latest token may still be on the device, drawn by the
step in flight: `pending` names it, and the counts include it without waiting for it.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nanoserve.grammar import apply_bitmask
from nanoserve.sampling import SamplingParams


@dataclass(frozen=True)
class RowHistory:
    """What the processors read of one request besides its parameters."""

    output_token_ids: Sequence[int]
    prompt_token_ids: Sequence[int]
    # The token the step in flight is drawing for it, on the device: (that step's tokens, row).
    pending: tuple[torch.Tensor, int] | None = None
    # Tokens min_tokens holds back: the EOS ids (unless ignore_eos) and stop_token_ids.
    min_tokens_stop_ids: frozenset[int] = frozenset()
    bad_words_token_ids: Sequence[Sequence[int]] = ()

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids) + (self.pending is not None)


NO_HISTORY = RowHistory((), ())  # for rows whose parameters read none


def process_rows(rows: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[RowHistory],
                 grammar_bitmask: torch.Tensor | None = None) -> None:
    """Apply every processor the rows' parameters ask for, in place, in vLLM v1's order: the
    masks and biases, then the penalties. `rows` is float32 [len(params), vocab];
    `grammar_bitmask` (int32 [len(params), vocab/32], or None) holds the structured-output
    rows' allowed tokens, all bits set for the others."""
    device, vocab = rows.device, rows.shape[1]
    if grammar_bitmask is not None:
        apply_bitmask(rows, grammar_bitmask)  # it moves the bits to the rows' device itself
    allowed = [(j, p.allowed_token_ids) for j, p in enumerate(params) if p.allowed_token_ids is not None]
    if allowed:
        keep = torch.zeros_like(rows, dtype=torch.bool)
        for j, ids in allowed:
            keep[j, [t for t in ids if t < vocab]] = True
        selected = torch.tensor([j for j, _ in allowed], device=device)
        rows[selected] = rows[selected].masked_fill(~keep[selected], float("-inf"))
    banned: list[tuple[int, int]] = []  # (row, token)
    for j, (p, history) in enumerate(zip(params, histories)):
        if p.min_tokens and history.num_output_tokens < p.min_tokens:
            banned.extend((j, t) for t in history.min_tokens_stop_ids if t < vocab)
        if history.bad_words_token_ids:
            banned.extend((j, t) for t in banned_by_bad_words(history.bad_words_token_ids, history.output_token_ids)
                          if t < vocab)
    if banned:
        at = (torch.tensor([r for r, _ in banned], device=device), torch.tensor([t for _, t in banned], device=device))
        before = rows[at]
        rows[at] = float("-inf")
        # A ban must not leave a row with nothing to draw (a grammar that allows only EOS while
        # min_tokens holds EOS back): there the grammar wins and the row's bans are lifted.
        dead = torch.isinf(rows).all(dim=1)[at[0]]
        rows[at] = torch.where(dead, before, rows[at])  # no boolean indexing: no wait for the device
    biased = [(j, t, b) for j, p in enumerate(params) if p.logit_bias for t, b in p.logit_bias.items() if t < vocab]
    if biased:
        r, t, b = zip(*biased)
        rows.index_put_((torch.tensor(r, device=device), torch.tensor(t, device=device)),
                        torch.tensor(b, device=device, dtype=rows.dtype), accumulate=True)
    penalized = [j for j, p in enumerate(params) if p.has_penalties]
    if penalized:
        apply_penalties(rows, [params[j] for j in penalized], [histories[j] for j in penalized],
                        torch.tensor(penalized, device=device) if len(penalized) < len(params) else None)


def banned_by_bad_words(bad_words_token_ids: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """HF's NoBadWordsLogitsProcessor: "a bad word's last token is banned if the tokens before it
    are the last tokens generated" (a one-token word is always banned)."""
    banned = []
    for word in bad_words_token_ids:
        prefix = len(word) - 1
        if prefix == 0 or (len(output) >= prefix and list(output[len(output) - prefix:]) == list(word[:-1])):
            banned.append(word[-1])
    return banned


def apply_penalties(rows: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[RowHistory],
                    index: torch.Tensor | None) -> None:
    """The three penalties, batched over the rows `index` selects (None: all rows).

    * repetition (CTRL, Keskar et al. 2019, as HF and vLLM apply it): for every token in the
      prompt or the output, "logit / penalty if logit > 0 else logit * penalty";
    * frequency and presence (OpenAI's API reference): "mu[j] -> mu[j] - c[j] * alpha_frequency
      - float(c[j] > 0) * alpha_presence", c[j] counting token j in the output only.

    Nothing is kept between steps, so preemption, swaps and discarded steps need no bookkeeping.
    On a GPU the counts are dense, [rows, vocab], built by one scatter-add (vLLM's sampler's
    way: no wait for the device); on a CPU only the (row, token) pairs that occur are touched,
    a few hundred per row instead of ten passes over the vocabulary (60 -> ~5 ms for 64 rows,
    benchmarks/sampling.py)."""
    device = rows.device
    block = rows if index is None else rows[index]
    pending = [(j, h.pending) for j, h in enumerate(histories) if h.pending is not None]
    pending_rows = torch.tensor([j for j, _ in pending], device=device, dtype=torch.int64)
    # asynchronous scheduling: the tokens the step in flight draws, still on the device
    pending_tokens = (torch.stack([tokens[i] for _, (tokens, i) in pending]).to(device) if pending
                      else torch.zeros(0, device=device, dtype=torch.int64))
    repetition = torch.tensor([p.repetition_penalty for p in params], device=device)
    frequency = torch.tensor([p.frequency_penalty for p in params], device=device)
    presence = torch.tensor([p.presence_penalty for p in params], device=device)
    if device.type == "cpu":
        _sparse_penalties(block, histories, (pending_rows, pending_tokens), repetition, frequency, presence)
    else:
        block = _dense_penalties(block, histories, (pending_rows, pending_tokens), repetition, frequency, presence)
    if index is None:
        if block is not rows:
            rows.copy_(block)
    else:
        rows[index] = block


def _occurrences(token_lists: Sequence[Sequence[int]], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every (row, token) pair of the lists, as two int64 tensors on the host; ids past the
    vocabulary are dropped, as `_token_counts` drops them (not moved onto the last token)."""
    lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.int64)
    tokens = torch.tensor([t for ts in token_lists for t in ts], dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(len(token_lists)), lengths)
    inside = tokens < vocab
    return rows[inside], tokens[inside]


def _sparse_penalties(block: torch.Tensor, histories: Sequence[RowHistory],
                      pending: tuple[torch.Tensor, torch.Tensor], repetition: torch.Tensor,
                      frequency: torch.Tensor, presence: torch.Tensor) -> None:
    """In place, touching only the tokens that occur (a CPU's way; see apply_penalties)."""
    vocab = block.shape[1]
    out_rows, out_tokens = _occurrences([h.output_token_ids for h in histories], vocab)
    out_rows, out_tokens = torch.cat([out_rows, pending[0]]), torch.cat([out_tokens, pending[1]])
    keys, counts = torch.unique(out_rows * vocab + out_tokens, return_counts=True)
    if bool((repetition != 1).any()):
        prompt_rows, prompt_tokens = _occurrences([h.prompt_token_ids for h in histories], vocab)
        seen = torch.unique(torch.cat([prompt_rows * vocab + prompt_tokens, keys]))
        r, t = seen // vocab, seen % vocab
        values, penalty = block[r, t], repetition[r]
        block[r, t] = torch.where(values > 0, values / penalty, values * penalty)
    r, t = keys // vocab, keys % vocab
    block.index_put_((r, t), -(counts.to(block.dtype) * frequency[r] + presence[r]), accumulate=True)


def _dense_penalties(block: torch.Tensor, histories: Sequence[RowHistory],
                     pending: tuple[torch.Tensor, torch.Tensor], repetition: torch.Tensor,
                     frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """The penalized block, from [rows, vocab] counts (a GPU's way: no wait for the device)."""
    device, vocab = block.device, block.shape[1]
    counts = _token_counts([h.output_token_ids for h in histories], vocab, device)
    counts.index_put_(pending, torch.ones_like(pending[1], dtype=counts.dtype), accumulate=True)
    if bool((repetition != 1).any()):
        seen = (_token_counts([h.prompt_token_ids for h in histories], vocab, device) > 0) | (counts > 0)
        penalty = repetition.unsqueeze(1)
        block = torch.where(seen, torch.where(block > 0, block / penalty, block * penalty), block)
    return block - counts * frequency.unsqueeze(1) - torch.where(counts > 0, presence.unsqueeze(1), 0.0)


def _token_counts(token_lists: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] float32 counts of each token id in each list (ids past the vocabulary, which
    a prompt given as ids cannot have, would land in a dropped padding column)."""
    width = max((len(t) for t in token_lists), default=0)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    if width:
        padded = torch.full((len(token_lists), width), vocab, dtype=torch.int64)
        for j, tokens in enumerate(token_lists):
            padded[j, :len(tokens)] = torch.as_tensor(tokens, dtype=torch.int64).clamp(max=vocab)
        padded = padded.to(device, non_blocking=True)
        counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab]


def apply_min_p(rows: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """HF's MinPLogitsWarper (after temperature): "tokens with probability below min_p times the
    most likely token's are removed"; min_p == 0 keeps every token."""
    probs = rows.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return rows.masked_fill(probs < threshold, float("-inf"))


# top-k / top-p without sorting the vocabulary: a sort of 64 x 49,152 logits takes ~100 ms on
# our 2-core CPU, their top 64 ~2 ms (benchmarks/sampling.py). A nucleus of top_p = 0.9 of a
# trained model's logits usually lies within the top few dozen tokens, so the top candidates are
# sorted and summed, in tiers (TOP_P_TIERS: 64, then 1,024 for the rows whose nucleus is wider);
# a row whose nucleus is wider still (a flat distribution) finds its cut-off by bisection on the
# probability, BISECTION_STEPS passes over the row, never a sort (about as slow as one there).
TOP_P_TIERS = (64, 1024)
BISECTION_STEPS = 24


def apply_top_k_top_p(rows: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and top-p nucleus. top_k == 0: no limit.

    The nucleus is HF's and vLLM's: the most likely tokens, in order, up to and including the one
    whose cumulative probability first reaches top_p (always at least one). Exact where the cut
    falls within a tier's candidates; otherwise, by bisection, up to probabilities within
    2**-BISECTION_STEPS of the cut-off's (ties at a cut-off, top-k's included, are all kept)."""
    vocab = rows.shape[-1]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
    limited = bool((k < vocab).any())
    if limited:  # top-k: keep what is at least the k-th largest logit
        kth = rows.topk(int(k.max()), dim=-1).values.gather(1, (k - 1).unsqueeze(1))
        rows = rows.masked_fill(rows < kth, float("-inf"))
    nucleus = top_p < 1
    if not bool(nucleus.any()):
        return rows
    probs = rows.softmax(dim=-1)
    keep = torch.zeros_like(rows, dtype=torch.bool)
    keep |= ~nucleus.unsqueeze(1)
    pending = nucleus.nonzero().squeeze(1)  # rows whose cut-off is not found yet
    floor = probs.new_ones(rows.shape[0], 1)  # below this lies a pending row's cut-off
    for tier in TOP_P_TIERS:
        width = min(vocab, max(tier, int(k.max()) if limited else 0))
        top_probs, top_ids = probs[pending].topk(width, dim=-1)  # sorted, largest first
        mass_before = top_probs.cumsum(dim=-1) - top_probs
        keep_sorted = mass_before < top_p[pending].unsqueeze(1)
        keep_sorted[:, 0] = True
        # The cut lies within the candidates if the mass before the last one already reaches top_p.
        resolved = ~keep_sorted[:, -1] | (width == vocab)
        done = pending[resolved]
        keep[done] = torch.zeros_like(keep[done]).scatter_(1, top_ids[resolved], keep_sorted[resolved])
        floor[pending] = top_probs[:, -1:]
        pending = pending[~resolved]
        if not len(pending):
            return rows.masked_fill(~keep, float("-inf"))
    keep[pending] = _nucleus_by_bisection(probs[pending], top_p[pending], floor[pending])
    return rows.masked_fill(~keep, float("-inf"))


def _nucleus_by_bisection(probs: torch.Tensor, top_p: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """The keep-mask of each row's nucleus: tokens at least as likely as the largest threshold
    t whose tokens (p >= t) still hold top_p of the mass, searched below `high` ([rows, 1])."""
    low = torch.zeros(probs.shape[0], 1, device=probs.device, dtype=probs.dtype)
    target = top_p.unsqueeze(1)
    for _ in range(BISECTION_STEPS):
        mid = (low + high) / 2
        # torch.where, not probs * mask: a float-by-bool product is 8x slower on a CPU
        enough = torch.where(probs >= mid, probs, 0.0).sum(dim=-1, keepdim=True) >= target
        low = torch.where(enough, mid, low)
        high = torch.where(enough, high, mid)
    return probs >= low
