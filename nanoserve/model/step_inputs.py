"""A step's small inputs in one buffer, sent to the device with one copy (issue 47: "write step
inputs straight into the graphs' static buffers with one copy"; the idea is vLLM v1's
persistent input buffers, the code ours).

A forward reads six small integer arrays besides the block table. Each used to be its own host
tensor and its own host-to-device copy, and a graphed step then copied each again into its
graph's static buffers and padded them there: about 17 launches a step, each some microseconds
of host time that, in a graphed decode step, runs in series with the GPU. Here they are laid out
in one int64 buffer, every field starting on a 16-byte boundary (Triton specializes kernels on
pointer alignment):

    | input_ids | positions | slot_mapping | sample_index | seq_lens  | query_start_loc |
    | [T] int64 | [T] int64 | [T] int64    | [S] int64    | [S] int32 | [S+1] int32     |
    (each field rounded up to an even number of int64 slots; the int32 fields are int32 views)

T is the number of token rows, S of sequence rows. The host fills it, page-locked on CUDA, with
the step's values and then the padding, and it travels with one copy: into a fresh device buffer
for an eager step (T and S the step's own sizes: no padding), or straight into a CUDA graph's
own static buffer (T and S the graph's shape), over whose views the graph was recorded
(cuda_graphs.py). So a graphed step's inputs cost one copy and no device-side copies at all. The
block table, up to megabytes at long contexts, keeps its own copy of only the rows and columns
the step has.

Padding, for rows past the step's own (n tokens, s sequences, k sampling rows):

    input_ids, positions   0          never read for a result
    slot_mapping           -1         store_kv writes nothing
    sample_index           0          a mixed graph's LM head reads row 0; never returned
    seq_lens               1          a padding sequence's one key: slot 0 of a real page
    query_start_loc        decode graphs: n+1, n+2, ... (each padding sequence has one padding
                           token, as a decode graph's rows are tokens and sequences at once);
                           mixed graphs: n (padding sequences are empty; tokens past n belong
                           to no sequence, and the starts must not decrease: the kernels find a
                           token's sequence by binary search)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


class StepInputViews(NamedTuple):
    """The fields of a step-input buffer, as tensors over it."""

    input_ids: torch.Tensor  # int64
    positions: torch.Tensor  # int64
    slot_mapping: torch.Tensor  # int64
    sample_index: torch.Tensor  # int64
    seq_lens: torch.Tensor  # int32
    query_start_loc: torch.Tensor  # int32


def _even(slots: int) -> int:
    return slots + slots % 2  # int64 slots, so a field after it starts 16-byte aligned


@dataclass(frozen=True)
class StepInputLayout:
    num_tokens: int  # T: token rows
    num_seqs: int  # S: sequence rows
    padding_sequences_take_a_token: bool = False  # a decode graph's layout (see the padding table)

    def _offsets(self) -> tuple[int, int, int, int]:
        """In int64 slots: t, each token field's length (positions start at t, slot_mapping at
        2t, sample_index at 3t); where seq_lens and query_start_loc start; where the buffer ends."""
        t = _even(self.num_tokens)
        lens = 3 * t + _even(self.num_seqs)
        starts = lens + _even((self.num_seqs + 1) // 2)
        return t, lens, starts, starts + _even((self.num_seqs + 2) // 2)

    @property
    def size(self) -> int:
        """The buffer's length in int64 slots."""
        return self._offsets()[3]

    def views(self, buffer: torch.Tensor, num_tokens: int | None = None, num_seqs: int | None = None,
              num_samples: int | None = None) -> StepInputViews:
        """The fields of `buffer` (int64, `size` slots, on any device), each cut to the given
        row counts (default: the whole layout, as a graph reads them)."""
        n = self.num_tokens if num_tokens is None else num_tokens
        s = self.num_seqs if num_seqs is None else num_seqs
        k = self.num_seqs if num_samples is None else num_samples
        t, lens, starts, _ = self._offsets()
        ints = buffer.view(torch.int32)  # the int32 fields' views count int32 elements: twice the slots
        return StepInputViews(buffer[:n], buffer[t : t + n], buffer[2 * t : 2 * t + n], buffer[3 * t : 3 * t + k],
                              ints[2 * lens : 2 * lens + s], ints[2 * starts : 2 * starts + s + 1])

    def pack(self, input_ids: list[int], positions: list[int], slot_mapping: list[int], sample_rows: list[int],
             seq_lens: list[int], query_start_loc: list[int], pin_memory: bool) -> torch.Tensor:
        """The step's values and the padding in one host buffer (page-locked with `pin_memory`:
        PyTorch's pinned allocator then keeps it until the copy that reads it has run, so a
        buffer is never refilled under a copy still queued)."""
        n, s, k = len(input_ids), len(seq_lens), len(sample_rows)
        if n > self.num_tokens or s > self.num_seqs or k > s:
            raise ValueError(f"a step of {n} tokens, {s} sequences and {k} samples does not fit "
                             f"{self.num_tokens} tokens and {self.num_seqs} sequences")
        host = torch.empty(self.size, dtype=torch.int64, pin_memory=pin_memory)
        whole = self.views(host)
        # numpy writes a Python list into memory in one C loop; torch would build a tensor first.
        ids, pos, slots, samples = (v.numpy() for v in whole[:4])
        lens, starts = whole.seq_lens.numpy(), whole.query_start_loc.numpy()
        ids[:n], ids[n:] = input_ids, 0
        pos[:n], pos[n:] = positions, 0
        slots[:n], slots[n:] = slot_mapping, -1
        samples[:k], samples[k:] = sample_rows, 0
        lens[:s], lens[s:] = seq_lens, 1
        starts[: s + 1] = query_start_loc
        if self.padding_sequences_take_a_token:
            starts[s + 1 :] = range(n + 1, n + 1 + self.num_seqs - s)
        else:
            starts[s + 1 :] = n
        return host
