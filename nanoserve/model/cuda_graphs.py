"""CUDA graphs for engine steps (vLLM's CUDA-graph runner, nano-vllm's `capture_cudagraph`).

A step of a small model is bound by the CPU launching its kernels, not by the GPU: about 9
launches per layer with the fused ops (45 without), each tens of microseconds of Python and
driver on the host. Measured on an H200 (benchmarks/RESULTS.md): a 1B-shaped model's eager decode
step at batch 64 took 11-17 ms against a 0.97 ms HBM roofline. A CUDA graph records one step's
kernels once and replays them with a single launch.

A graph replays fixed addresses and fixed shapes, so each shape gets its own graph, recorded
over its own static input buffer and padded up to it. Two families:

  decode graphs, one per batch size b (1, 2, 4, 8, then every 8 up to max_num_seqs): every
  sequence decodes one token, so tokens = sequences = b; the LM head runs on all b rows.

  mixed graphs (ours, off by default: `mixed_graph_sizes`), one per token count t > max_num_seqs:
  any batch of up to t tokens over up to S = max_num_seqs sequences (prompt chunks and decodes
  together, vLLM v1's "full" CUDA graphs for mixed batches). The sequences are padded to S with
  empty ones, the tokens to t with tokens of no sequence; the LM head runs on S rows gathered
  by a static index (the rows that sample, then row 0 as padding).

    each graph's static inputs (device), one buffer laid out as step_inputs.py's StepInputLayout
      input_ids, positions, slot_mapping   [b or t]
      sample_index, seq_lens               [b or S]
      query_start_loc                      [b + 1 or S + 1]
    written, padding included, by one copy from the host before every replay (the runner packs
    the step's inputs in the layout of the graph that will run it: `inputs_for`)

    block_tables [S, max_blocks] (device), shared by every graph: each step copies its own
      [s, width] table into the corner; rows and columns past it keep what earlier steps wrote

A padding row of a decode graph attends to slot 0 of the page its block-table row holds: page 0
when the buffer was made, else the first page of some earlier step's sequence. Every entry the
table ever holds is a real page of this cache, and a page holds finite values (the cache starts
zeroed and only ever receives K/V); in a mixed graph the attention kernel finds no
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

Before issue 47 the runner copied each input to the device on its own and a replay then copied
each into shared static buffers and padded them there: about 17 launches a graphed step. Now the
runner makes two copies, three launches: the table's corner is strided, so PyTorch stages that
copy through a contiguous device buffer.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING

import torch

from nanoserve.model.attention import AttentionBackend, ForwardContext
from nanoserve.model.causal_lm import CausalLM
from nanoserve.model.step_inputs import StepInputLayout, StepInputViews

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
        max_seqs = max(self.buckets[-1] if self.buckets else 0, self.max_seqs)
        self.max_blocks = max_blocks
        self.block_tables = torch.zeros((max_seqs, max_blocks), dtype=torch.int32, device=device)
        seqs = self.max_seqs
        self._inputs: dict[tuple[str, int], tuple[StepInputLayout, torch.Tensor]] = {}
        self._views: dict[tuple[str, int], StepInputViews] = {}
        self._contexts: dict[tuple[str, int], ForwardContext] = {}
        for key, layout, rows in ([(("decode", b), StepInputLayout(b, b, padding_sequences_take_a_token=True), b)
                                   for b in self.buckets]
                                  + [(("mixed", t), StepInputLayout(t, seqs), seqs) for t in self.mixed_sizes]):
            # Padding throughout until a step writes it: what the warm-up and the recording read.
            buffer = layout.pack([], [], [], [], [], [0], pin_memory=False).to(device)
            views = layout.views(buffer)
            self._inputs[key], self._views[key] = (layout, buffer), views
            self._contexts[key] = ForwardContext(views.slot_mapping, self.block_tables[:rows], views.seq_lens,
                                                 views.query_start_loc, kv_caches, backend)
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
        views = self._views["decode", b]
        hidden = self.model(views.input_ids, views.positions, self._contexts["decode", b], None)
        return self.model.compute_logits(hidden)

    def _mixed_forward(self, t: int) -> torch.Tensor:
        views = self._views["mixed", t]
        hidden = self.model(views.input_ids, views.positions, self._contexts["mixed", t], None)
        return self.model.compute_logits(hidden.index_select(0, views.sample_index))

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

    def inputs_for(self, kind: str, num_tokens: int) -> tuple[StepInputLayout, torch.Tensor]:
        """The layout and the static input buffer of the graph that runs a step of `num_tokens`
        tokens: "decode" (one token per sequence) or "mixed". The runner packs the step in this
        layout and copies it into this buffer, then calls `replay` or `replay_mixed`."""
        size = self.bucket_for(num_tokens) if kind == "decode" else self.mixed_size_for(num_tokens)
        assert size is not None, f"no {kind} graph holds {num_tokens} tokens"
        return self._inputs[kind, size]

    def write_block_table(self, table: torch.Tensor) -> torch.Tensor:
        """Copy a step's [s, width] block table (on the host, page-locked on CUDA) into the
        shared static table's corner; returns that corner."""
        s, width = table.shape
        corner = self.block_tables[:s, :width]
        corner.copy_(table, non_blocking=True)
        return corner

    def views(self, kind: str, size: int) -> StepInputViews:
        """A graph's static inputs (what tests and benchmarks read)."""
        return self._views[kind, size]

    @torch.inference_mode()
    def replay(self, num_tokens: int) -> torch.Tensor:
        """The logits of a decode batch of `num_tokens` sequences whose inputs are in its graph's
        buffer (`inputs_for`) and whose table is in the static one (`write_block_table`)."""
        b = self.bucket_for(num_tokens)
        assert b is not None
        self.num_replays += 1
        return self._replays[b]()[:num_tokens]

    @torch.inference_mode()
    def replay_mixed(self, num_tokens: int, num_samples: int) -> torch.Tensor:
        """The logits of the `num_samples` rows that sample (the step's sample_index, in its
        graph's buffer) of a batch of `num_tokens` tokens that a mixed graph holds."""
        t = self.mixed_size_for(num_tokens)
        assert t is not None
        self.num_mixed_replays += 1
        return self._mixed_replays[t]()[:num_samples]
