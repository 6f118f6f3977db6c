"""CUDA graphs for decode steps (vLLM's CUDA-graph runner, nano-vllm's `capture_cudagraph`).

A decode step of a small model is bound by the CPU launching its kernels, not by the GPU: about
45 launches per layer, so 720 for a 16-layer model. Measured on an H200 (benchmarks/RESULTS.md):
a 1B-shaped model's eager decode step at batch 64 took 17 ms against a 0.97 ms HBM roofline. A
CUDA graph records one step's kernels once and replays them with a single launch.

A graph replays fixed addresses and fixed shapes, so each batch size gets its own graph over
static buffers. A batch of n decodes replays the graph of the smallest bucket b >= n, with rows
n..b-1 padded:

    static buffers (device, sized for the largest bucket), written before every replay
      input_ids       [max_bs]              real ids          | pad: 0
      positions       [max_bs]              real positions    | pad: 0
      slot_mapping    [max_bs]              real slots        | pad: -1 (store_kv writes nothing)
      seq_lens        [max_bs]              real lengths      | pad: 1 (reads page 0, slot 0)
      block_tables    [max_bs, max_blocks]  real tables       | pad: page 0
      query_start_loc [max_bs + 1]          0, 1, 2, ... (one token per sequence; never rewritten)
    buckets: 1, 2, 4, 8, then every 8 up to max_num_seqs; each graph runs the forward over the
    first b rows and the LM head; the caller reads the first n rows of its logits.

A padding row attends to one slot of page 0, which holds finite values (the cache starts zeroed
and only ever receives K/V), and its logits are never read. The attention kernel's loop over a
sequence's context reads `seq_lens` from the device, so one graph serves any context length;
only the block table's width is fixed, at `max_blocks` (the longest request's pages).

What a graph cannot replay runs eagerly, as before: a batch with any prefill token, a BROS
right-to-left sequence, more sequences than the largest bucket, a forward with ConServe's safe
points armed or with copies to wait for layer by layer (both run Python between layers), and
any runner whose layers change (KunServe's arena) or that talks to other ranks.

`record=False` (a CPU, for tests) keeps every step of this path but the recording: a replay
runs the forward over the same static buffers and padding.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from nanoserve.model.attention import AttentionBackend, ForwardContext


def decode_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to `max_num_seqs` (which is always the last)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 8))
    return sorted(set(sizes + [max_num_seqs]))


class DecodeGraphs:
    def __init__(self, model: nn.Module, kv_caches: list, backend: AttentionBackend, buckets: Sequence[int],
                 max_blocks: int, device: torch.device, record: bool | None = None):
        self.model, self.device = model, device
        self.buckets = sorted(buckets)
        self.record = device.type == "cuda" if record is None else record
        max_bs = self.buckets[-1]
        self.max_blocks = max_blocks

        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids = zeros(max_bs, dtype=torch.int64)
        self.positions = zeros(max_bs, dtype=torch.int64)
        self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32, device=device)
        self.block_tables = zeros(max_bs, max_blocks, dtype=torch.int32)
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        self._contexts = {b: ForwardContext(self.slot_mapping[:b], self.block_tables[:b], self.seq_lens[:b],
                                            self.query_start_loc[:b + 1], kv_caches, backend)
                          for b in self.buckets}
        self._replays: dict[int, Callable[[], torch.Tensor]] = {}
        self._pool = None
        self.num_replays = 0  # steps served by a graph (what tests and benchmarks read)
        for b in reversed(self.buckets):  # largest first: the smaller graphs reuse its memory pool
            self._replays[b] = self._capture(b)

    def _forward(self, b: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:b], self.positions[:b], self._contexts[b], None)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def _capture(self, b: int) -> Callable[[], torch.Tensor]:
        if not self.record:
            return lambda: self._forward(b)
        for _ in range(2):  # warm-up: Triton compiles this shape's variants, cuBLAS picks kernels
            self._forward(b)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(b)
        if self._pool is None:
            self._pool = graph.pool()

        def replay() -> torch.Tensor:
            graph.replay()
            return logits

        return replay

    def bucket_for(self, num_seqs: int) -> int | None:
        for b in self.buckets:
            if b >= num_seqs:
                return b
        return None

    def can_replay(self, num_seqs: int, all_decode: bool, max_table_width: int) -> bool:
        return all_decode and num_seqs <= self.buckets[-1] and max_table_width <= self.max_blocks

    @torch.inference_mode()
    def replay_static(self, bucket: int) -> torch.Tensor:
        """Replay `bucket`'s graph on whatever the static buffers hold (benchmarks time the
        forward alone this way); not counted in `num_replays`."""
        return self._replays[bucket]()

    @torch.inference_mode()
    def replay(self, ctx: ForwardContext, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The logits of a decode batch whose step inputs the runner prepared (`ctx`, ids and
        positions, one row per sequence): copied into the static buffers, padded, replayed."""
        n = input_ids.shape[0]
        b = self.bucket_for(n)
        assert b is not None and ctx.directions is None
        width = ctx.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(ctx.slot_mapping)
        self.seq_lens[:n].copy_(ctx.seq_lens)
        self.block_tables[:n, :width].copy_(ctx.block_tables)
        if b > n:  # rows an earlier, larger batch filled become padding again
            self.input_ids[n:b].zero_()
            self.positions[n:b].zero_()
            self.slot_mapping[n:b].fill_(-1)
            self.seq_lens[n:b].fill_(1)
            self.block_tables[n:b, 0].zero_()
        self.num_replays += 1
        return self._replays[b]()[:n]
