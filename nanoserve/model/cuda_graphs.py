"""CUDA graphs for engine steps (vLLM's CUDA-graph runner, nano-vllm's `capture_cudagraph`).

A step of a small model is bound by the CPU launching its kernels, not by the GPU: about 9
launches per layer with the fused ops (45 without), each tens of microseconds of Python and
driver on the host. Measured on an H200 (benchmarks/RESULTS.md): a 1B-shaped model's eager decode
step at batch 64 took 11-17 ms against a 0.97 ms HBM roofline. A CUDA graph records one step's
kernels once and replays them with a single launch.

A graph replays fixed addresses and fixed shapes, so each shape gets its own graph over static
buffers, padded up to it. Two families share the buffers:

  decode graphs, one per batch size b (1, 2, 4, 8, then every 8 up to max_num_seqs): every
  sequence decodes one token, so tokens = sequences = b; the LM head runs on all b rows.

  mixed graphs (ours, off by default: `mixed_graph_sizes`), one per token count t > max_num_seqs:
  any batch of up to t tokens over up to S = max_num_seqs sequences (prompt chunks and decodes
  together, vLLM v1's "full" CUDA graphs for mixed batches). The sequences are padded to S with
  empty ones, the tokens to t with tokens of no sequence; the LM head runs on S rows gathered
  by a static index (the rows that sample, then row 0 as padding).

    static buffers (device), written before every replay
      input_ids      [T]              real ids        | pad: 0
      positions      [T]              real positions  | pad: 0
      slot_mapping   [T]              real slots      | pad: -1 (store_kv writes nothing)
      seq_lens       [S]              real lengths    | pad: 1 (decode: reads page 0, slot 0;
                                                               mixed: never read, its query is empty)
      block_tables   [S, max_blocks]  real tables     | decode pad: page 0
      decode qsl     [S + 1]          0, 1, 2, ... (one token per sequence; never rewritten)
      mixed qsl      [S + 1]          real starts     | pad: the real token count (empty sequences)
      sample_index   [S]              rows that sample | pad: 0
    T = the largest graph's token count, S = its sequence count; each graph reads a prefix.

A padding row of a decode graph attends to one slot of page 0, which holds finite values (the
cache starts zeroed and only ever receives K/V); in a mixed graph the attention kernel finds no
sequence for a padding token and skips it. Padding rows' outputs are never read. The kernels
read `seq_lens` and `query_start_loc` from the device, so one graph serves any context lengths
and any split of its tokens into sequences; only the block table's width is fixed, at
`max_blocks` (the longest request's pages). A mixed graph needs t > S: a batch with as many
tokens as sequences is taken for pure decode by the attention kernels' launch choices.

What a graph cannot replay runs eagerly, as before: a BROS right-to-left sequence, a batch
larger than the largest graph, a forward with ConServe's safe points armed or with copies to
wait for layer by layer (both run Python between layers), and any runner whose layers change
(KunServe's arena) or that talks to other ranks.

`record=False` (a CPU, for tests) keeps every step of this path but the recording: a replay
runs the forward over the same static buffers and padding.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING

import torch

from nanoserve.model.attention import AttentionBackend, ForwardContext
from nanoserve.model.causal_lm import CausalLM

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE  # a private torch name: for the annotation only


def decode_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to `max_num_seqs` (which is always the last)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 8))
    return sorted(set(sizes + [max_num_seqs]))


def mixed_buckets(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """Token counts for mixed graphs: from the first power of two above `max_num_seqs`, each
    size then 1.5x and 2x the last power of two (padding wastes at most a third), up to the
    token budget (always the last)."""
    if max_num_batched_tokens <= max_num_seqs:
        return []  # no batch has more tokens than sequences to spare
    sizes, power = [], 1 << max_num_seqs.bit_length()
    while power < max_num_batched_tokens:
        sizes += [power, power + power // 2]
        power *= 2
    return sorted({t for t in sizes if max_num_seqs < t < max_num_batched_tokens} | {max_num_batched_tokens})


class StepGraphs:
    def __init__(self, model: CausalLM, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor] | None],
                 backend: AttentionBackend, buckets: Sequence[int],
                 max_blocks: int, device: torch.device, record: bool | None = None,
                 mixed_sizes: Sequence[int] = (), max_num_seqs: int = 0):
        """`buckets`: decode batch sizes; `mixed_sizes`: token counts of mixed graphs over up to
        `max_num_seqs` sequences (each must exceed it)."""
        self.model, self.device = model, device
        self.buckets = sorted(buckets)
        self.mixed_sizes = sorted(mixed_sizes)
        if self.mixed_sizes and self.mixed_sizes[0] <= max_num_seqs:
            raise ValueError(f"a mixed graph needs more tokens than sequences: {self.mixed_sizes[0]} <= "
                             f"max_num_seqs {max_num_seqs}")
        self.record = device.type == "cuda" if record is None else record
        self.max_seqs = max_num_seqs if self.mixed_sizes else 0
        max_tokens = max(self.buckets[-1] if self.buckets else 0, self.mixed_sizes[-1] if self.mixed_sizes else 0)
        max_seqs = max(self.buckets[-1] if self.buckets else 0, self.max_seqs)
        self.max_blocks = max_blocks

        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids = zeros(max_tokens, dtype=torch.int64)
        self.positions = zeros(max_tokens, dtype=torch.int64)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(max_seqs, dtype=torch.int32, device=device)
        self.block_tables = zeros(max_seqs, max_blocks, dtype=torch.int32)
        self.query_start_loc = torch.arange(max_seqs + 1, dtype=torch.int32, device=device)
        self.mixed_query_start_loc = zeros(max_seqs + 1, dtype=torch.int32)
        self.sample_index = zeros(max_seqs, dtype=torch.int64)
        self._contexts = {b: ForwardContext(self.slot_mapping[:b], self.block_tables[:b], self.seq_lens[:b],
                                            self.query_start_loc[:b + 1], kv_caches, backend)
                          for b in self.buckets}
        seqs = self.max_seqs
        self._mixed_contexts = {t: ForwardContext(self.slot_mapping[:t], self.block_tables[:seqs], self.seq_lens[:seqs],
                                                  self.mixed_query_start_loc[:seqs + 1], kv_caches, backend)
                                for t in self.mixed_sizes}
        self._replays: dict[int, Callable[[], torch.Tensor]] = {}
        self._mixed_replays: dict[int, Callable[[], torch.Tensor]] = {}
        self._pool: _POOL_HANDLE | None = None
        self.num_replays = 0  # decode steps served by a graph (what tests and benchmarks read)
        self.num_mixed_replays = 0
        # Largest first: the smaller graphs reuse its memory pool.
        for t in reversed(self.mixed_sizes):
            self._mixed_replays[t] = self._capture(partial(self._mixed_forward, t))
        for b in reversed(self.buckets):
            self._replays[b] = self._capture(partial(self._forward, b))

    def _forward(self, b: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:b], self.positions[:b], self._contexts[b], None)
        return self.model.compute_logits(hidden)

    def _mixed_forward(self, t: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:t], self.positions[:t], self._mixed_contexts[t], None)
        return self.model.compute_logits(hidden.index_select(0, self.sample_index[: self.max_seqs]))

    @torch.inference_mode()
    def _capture(self, forward: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        if not self.record:
            return forward
        for _ in range(2):  # warm-up: Triton compiles this shape's variants, cuBLAS picks kernels
            forward()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = forward()
        if self._pool is None:
            self._pool = graph.pool()

        def replay() -> torch.Tensor:
            graph.replay()
            return logits

        return replay

    def bucket_for(self, num_seqs: int) -> int | None:
        """The decode graph for a batch of `num_seqs` decodes (None: too large)."""
        return next((b for b in self.buckets if b >= num_seqs), None)

    def mixed_size_for(self, num_tokens: int) -> int | None:
        """The mixed graph for a batch of `num_tokens` tokens (None: too large, or none recorded)."""
        return next((t for t in self.mixed_sizes if t >= num_tokens), None)

    def can_replay(self, num_seqs: int, all_decode: bool, max_table_width: int) -> bool:
        """Can a decode graph run a batch of `num_seqs` sequences, all decoding one token?"""
        return (all_decode and bool(self.buckets) and num_seqs <= self.buckets[-1]
                and max_table_width <= self.max_blocks)

    def can_replay_mixed(self, num_tokens: int, num_seqs: int, max_table_width: int) -> bool:
        return (self.mixed_size_for(num_tokens) is not None and num_seqs <= self.max_seqs
                and max_table_width <= self.max_blocks)

    @torch.inference_mode()
    def replay_static(self, bucket: int) -> torch.Tensor:
        """Replay `bucket`'s decode graph on whatever the static buffers hold (benchmarks time
        the forward alone this way); not counted in `num_replays`."""
        return self._replays[bucket]()

    def _write_tokens(self, ctx: ForwardContext, input_ids: torch.Tensor, positions: torch.Tensor,
                      padded: int) -> None:
        """Copy the step's per-token inputs into the static buffers, padded to `padded` tokens."""
        n = input_ids.shape[0]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(ctx.slot_mapping)
        if padded > n:  # rows an earlier, larger batch filled become padding again
            self.input_ids[n:padded].zero_()
            self.positions[n:padded].zero_()
            self.slot_mapping[n:padded].fill_(-1)

    def _write_sequences(self, ctx: ForwardContext) -> int:
        s, width = ctx.block_tables.shape
        self.seq_lens[:s].copy_(ctx.seq_lens)
        self.block_tables[:s, :width].copy_(ctx.block_tables)
        return s

    @torch.inference_mode()
    def replay(self, ctx: ForwardContext, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The logits of a decode batch whose step inputs the runner prepared (`ctx`, ids and
        positions, one row per sequence): copied into the static buffers, padded, replayed."""
        n = input_ids.shape[0]
        b = self.bucket_for(n)
        assert b is not None and ctx.directions is None
        self._write_tokens(ctx, input_ids, positions, b)
        self._write_sequences(ctx)
        if b > n:  # padding sequences read one slot of page 0
            self.seq_lens[n:b].fill_(1)
            self.block_tables[n:b, 0].zero_()
        self.num_replays += 1
        return self._replays[b]()[:n]

    @torch.inference_mode()
    def replay_mixed(self, ctx: ForwardContext, input_ids: torch.Tensor, positions: torch.Tensor,
                     sample_index: torch.Tensor) -> torch.Tensor:
        """The logits of the rows `sample_index` names (flat-batch rows, on the device) of any
        batch a mixed graph holds: its inputs copied into the static buffers, padded, replayed."""
        n = input_ids.shape[0]
        t = self.mixed_size_for(n)
        assert t is not None and ctx.directions is None
        self._write_tokens(ctx, input_ids, positions, t)
        s = self._write_sequences(ctx)
        qsl = self.mixed_query_start_loc
        qsl[: s + 1].copy_(ctx.query_start_loc)
        qsl[s + 1:].fill_(n)  # empty sequences after the real ones: their queries start and end at n
        k = sample_index.shape[0]
        self.sample_index[:k].copy_(sample_index)
        self.sample_index[k:].zero_()
        self.num_mixed_replays += 1
        return self._mixed_replays[t]()[:k]
