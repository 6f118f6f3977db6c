"""The grid of synthetic batches a cost model is fitted on (BROS §4.1, "Inference cost
modeling": dummy batches with lengths on a grid of powers of two). The real profiler times them
on a runner (`nanoserve/tools/profile.py`, `nanoserve profile`); the simulator prices them on
its roofline (`sim/roofline.fitted_cost_model`). Each term of the cost model has its own axis, so
the fit can tell them apart: prefill chunks of several sizes, with and without a cached prefix
(alpha vs. beta), one to several chunks per batch (gamma vs. the iteration constant), decode
batches of several sizes and context lengths (delta vs. epsilon), and prefill mixed with decodes.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Grid:
    """The synthetic batches' sizes; every length is clipped to what the model and cache hold."""

    chunk_sizes: tuple[int, ...]  # prefill chunk lengths
    prefix_ratios: tuple[int, ...]  # prefix = ratio * chunk length (0: a fresh prompt)
    chunks_per_batch: tuple[int, ...]  # prefill chunks sharing one iteration
    decode_batch_sizes: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    repeats: int  # timed runs per batch (after one warm-up); the fastest is kept


QUICK = Grid((16, 64, 256), (0, 1, 3), (1, 2, 4), (1, 8, 32), (32, 256), repeats=3)
FULL = Grid((16, 64, 256, 1024, 2048), (0, 1, 3, 7), (1, 2, 4, 8), (1, 4, 16, 64, 128), (64, 512, 2048, 8192),
            repeats=5)


def synthetic_batches(grid: Grid, max_len: int, num_blocks: int, block_size: int) -> list[tuple[tuple[int, int], ...]]:
    """(prefix_len, num_new) batches covering the grid; a chunk never outgrows `max_len`, a batch
    never needs more than `num_blocks` KV blocks for its sequences (prefix + new tokens)."""
    batches: list[tuple[tuple[int, int], ...]] = []

    def add(batch: list[tuple[int, int]]) -> None:
        blocks = sum(-(-(p + c) // block_size) for p, c in batch)
        if batch and all(p + c <= max_len for p, c in batch) and blocks <= num_blocks:
            if tuple(batch) not in batches:
                batches.append(tuple(batch))

    for c in grid.chunk_sizes:
        for ratio in grid.prefix_ratios:
            add([(ratio * c, c)])  # one chunk: α against β along prefix and size
        for k in grid.chunks_per_batch[1:]:
            add([(0, c)] * k)  # several chunks: γ against the iteration constant
            add([(c, c)] * k)
    for n in grid.decode_batch_sizes:
        for ctx in grid.decode_contexts:
            add([(ctx - 1, 1)] * n)  # a decode's context is its prefix plus the new token
    mid_chunk = grid.chunk_sizes[len(grid.chunk_sizes) // 2]
    for n in grid.decode_batch_sizes[1:]:
        for ctx in grid.decode_contexts:
            add([(0, mid_chunk)] + [(ctx - 1, 1)] * n)  # mixed: Sarathi-style piggybacking
            add([(mid_chunk, mid_chunk)] + [(ctx - 1, 1)] * n)
    return batches
