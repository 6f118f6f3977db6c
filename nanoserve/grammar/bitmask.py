"""The token bitmask: which tokens each request's grammar allows next, one bit per token.

Constrained decoding needs, per request and per step, a yes/no for every token of the
vocabulary. SmolLM2 has 49,152 tokens; a byte per token would be 48 KiB per request per step,
a float32 bias 192 KiB. A *bit* per token is 6 KiB: 1,536 int32 words, each covering 32
consecutive tokens. Token `t` lives in word `t // 32` at bit `t % 32`, counted from the least
significant bit:

    word 0:  bit 0 = token 0,  bit 1 = token 1,  ...,  bit 31 = token 31
    word 1:  bit 0 = token 32, ...

Bit 1 means allowed. A row of all ones (every word -1 in two's complement) allows everything,
which is what `allocate_bitmask` starts with, so rows of requests without a grammar can share
the tensor untouched.

Why int32 words: it is the layout the grammar libraries write (llguidance and xgrammar both fill
such rows directly, from Rust/C++ threads, into memory we give them), it is the smallest the
GPU shifts efficiently, and it is compact enough to copy to the GPU every step (6 KiB a row).
The bitmask is filled on the CPU -- the grammar libraries run there -- in pinned memory when there
is a GPU, so that the copy to the logits' device can run asynchronously.

Applying it (`apply_bitmask`) expands the bits on the logits' device: shift each word right by
0..31 and keep the low bit, which turns a [rows, words] tensor into [rows, words, 32] bits that
read, flattened, in token order. Tokens whose bit is 0 get a logit of -inf, so sampling (greedy
or not) can never pick them. Logits may be wider than the bitmask covers (a model whose
embedding is padded past its tokenizer): those tokens are disallowed too.

nanoserve applies the mask with its own few lines of torch rather than llguidance's
`llguidance.torch` (which runs `torch.compile` on first use, a multi-second stall and a
compiler dependency on the serving path).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from nanoserve.grammar.matcher import GrammarMatcher

BITS_PER_WORD = 32


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row for a vocabulary of `vocab_size` tokens."""
    return (vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An int32 [rows, ceil(vocab_size / 32)] bitmask on the CPU, all tokens allowed; pinned when
    CUDA is available, so that `.to(device, non_blocking=True)` does not wait for the copy."""
    shape = (rows, bitmask_words(vocab_size))
    pin = torch.cuda.is_available()
    try:
        return torch.full(shape, -1, dtype=torch.int32, pin_memory=pin)
    except RuntimeError:  # pinning can fail (a container's locked-memory limit): pageable works too
        if not pin:
            raise
        return torch.full(shape, -1, dtype=torch.int32)


def check_bitmask(bitmask: torch.Tensor, vocab_size: int) -> None:
    """Raise ValueError unless `bitmask` is what the grammar libraries may write into: int32,
    2-D, contiguous, on the CPU, with rows of exactly `bitmask_words(vocab_size)` words."""
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.device.type != "cpu":
        raise ValueError(f"a grammar bitmask must be a 2-D int32 CPU tensor, got {bitmask.dtype} "
                         f"{tuple(bitmask.shape)} on {bitmask.device}")
    if not bitmask.is_contiguous():
        raise ValueError("a grammar bitmask must be contiguous (the libraries write whole rows by pointer)")
    if bitmask.shape[1] != bitmask_words(vocab_size):
        raise ValueError(f"a grammar bitmask for {vocab_size} tokens has {bitmask_words(vocab_size)} words "
                         f"per row, got {bitmask.shape[1]}")


def fill_bitmasks(matchers: Sequence[tuple[GrammarMatcher, int]], bitmask: torch.Tensor) -> None:
    """Fill `bitmask[row]` with the tokens each matcher allows next, for the whole batch at once.

    Matchers are grouped by class, and each class fills its rows in one call
    (`GrammarMatcher.fill_bitmasks`: llguidance's computes them in parallel on its thread pool).
    Rows not named are left as they are: set them to -1 (everything allowed) if they are used.
    """
    groups: dict[type[GrammarMatcher], list[tuple[GrammarMatcher, int]]] = {}
    for matcher, row in matchers:
        groups.setdefault(type(matcher), []).append((matcher, row))
    for cls, rows in groups.items():
        cls.fill_bitmasks(rows, bitmask)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set, in place, the logits of the tokens the bitmask disallows to -inf.

    `logits` is [rows, vocab] (or [vocab]) on any device; `bitmask` int32 [rows, words] (or
    [words]) on any device, one row per logits row -- the caller gathers the rows of the requests
    with a grammar and their bitmask rows. Tokens past the bitmask's 32 * words are disallowed.
    """
    if logits.dim() == 1:
        logits = logits.unsqueeze(0)  # a view: filling it fills the caller's tensor
    if bitmask.dim() == 1:
        bitmask = bitmask.unsqueeze(0)
    if bitmask.dtype != torch.int32 or logits.dim() != 2 or bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"apply_bitmask needs logits [rows, vocab] and an int32 bitmask [rows, words], got "
                         f"{tuple(logits.shape)} and {bitmask.dtype} {tuple(bitmask.shape)}")
    rows, width = logits.shape
    if logits.device.type == "cpu" and bitmask.device.type == "cpu":
        # On a CPU, numpy unpacks the bits in one C loop: little-endian words, so byte j of word w
        # holds tokens 32 w + 8 j ... + 7, least significant bit first (10x the shifts below).
        bits = np.unpackbits(bitmask.contiguous().numpy().view(np.uint8), axis=1, bitorder="little")
        allowed = torch.from_numpy(bits).view(torch.bool)
    else:
        words = bitmask.to(logits.device, non_blocking=True)
        shifts = torch.arange(BITS_PER_WORD, device=logits.device, dtype=torch.int32)
        # (word >> k) & 1 is bit k of the word. The shift is arithmetic (int32 is signed), so bit
        # 31's sign copies fill the high bits -- the `& 1` keeps only the bit we asked for.
        allowed = ((words.unsqueeze(-1) >> shifts) & 1).to(torch.bool).reshape(rows, -1)
    covered = min(width, allowed.shape[1])
    logits[:, :covered].masked_fill_(~allowed[:, :covered], float("-inf"))
    if covered < width:  # logits wider than the bitmask: those tokens are no grammar's
        logits[:, covered:] = float("-inf")
