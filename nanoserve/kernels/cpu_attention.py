"""Paged attention for the CPU's torch backend: nanoserve/kernels/reference.py's semantics, less memory traffic.

On a CPU, decode attention is bound by memory, not arithmetic: each decode row's K/V is
gathered out of the paged cache into a padded batch (a copy of every cached token it reads),
and SDPA then reads that copy again. The reference pads every decode row to the longest
context of the step; with mixed lengths most of what it copies is padding. Profiled on
benchmarks/throughput.py's 64 requests (benchmarks/profile_cpu.py, 2-core EPYC, fp32),
attention was 29% of the run, its gather and SDPA most of it. Three changes (ours), each
computing exactly what the reference computes:

1. Decode rows are grouped by context length before the gather: sorted by their number of
   blocks, a new group starts when a row's blocks exceed `GROUP_RATIO` x the group's first
   row's. Each group pads only to its own longest row, so the padding is below
   (GROUP_RATIO - 1) of what a group reads, for one more SDPA call per group.

       blocks per row   1 1 2 | 3 3 4 | 7 9 | 14 18 20      (GROUP_RATIO 1.5)
       one call each:   pad to 2 | pad to 4 | pad to 9 | pad to 20
       the reference:   every row padded to 20

2. A decode row's query heads are folded onto their KV head: [S, Hkv, H / Hkv, D] queries
   against [S, Hkv, L, D] keys is grouped-query attention with H / Hkv query rows per head,
   one SDPA matrix product per (row, KV head) instead of one per query head.

3. A prefill chunk that is the sequence's whole context (its first chunk) attends with
   `is_causal` over its own positions: no mask is built and SDPA skips the masked half.
   Later chunks keep the reference's mask (their queries are not at the keys' start).

4. Where the C kernel builds (nanoserve/kernels/cpu_decode_attention.py, the usual case on Linux), the
   decode rows skip 1 and 2 altogether: one call per layer reads their K/V in place, no gather.
   Measured inside the engine on a 2-core EPYC (SmolLM2, bf16, contexts 64-128): 37 against 80
   us a layer at batch 1, 103 against 163 at batch 8, 344 against 437 at batch 32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoserve.kernels import cpu_decode_attention
from nanoserve.kernels.reference import gather_kv

# ours: a decode group's longest row may hold this many times its shortest row's blocks.
GROUP_RATIO = 1.5


def decode_groups(num_blocks: dict[int, int], ratio: float = GROUP_RATIO) -> list[list[int]]:
    """Rows (keys of `num_blocks`) sorted by block count and cut where a row's count passes
    `ratio` x the first count of its group."""
    groups: list[list[int]] = []
    for row in sorted(num_blocks, key=num_blocks.__getitem__):
        if not groups or num_blocks[row] > ratio * num_blocks[groups[-1][0]]:
            groups.append([])
        groups[-1].append(row)
    return groups


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor,  # int32 [num_seqs]
    query_start_loc: torch.Tensor,  # int32 [num_seqs + 1]
    directions: torch.Tensor | None,  # bool [num_seqs] or None
    scale: float,
) -> torch.Tensor:
    """The reference's paged attention (nanoserve/kernels/reference.py), by the module docstring's path."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_heads, head_dim = q.shape[1], q.shape[2]
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()

    def gathered(seqs: torch.Tensor | slice, n_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[S, Hkv, n_blocks * block_size, D] keys and values of `seqs`, in position order."""
        dirs = directions[seqs] if directions is not None else None
        table = block_tables[seqs, :n_blocks]
        return (gather_kv(k_cache, table, dirs).transpose(1, 2), gather_kv(v_cache, table, dirs).transpose(1, 2))

    decode_seqs = [i for i in range(len(lens)) if starts[i + 1] - starts[i] == 1]
    # Where the C kernel is built (nanoserve/kernels/cpu_decode_attention.py), it reads the decode rows' K/V
    # in place, all rows in one call; otherwise they are gathered by length group for SDPA.
    if cpu_decode_attention.decode_attention(q, k_cache, v_cache, block_tables, seq_lens,
                                             [starts[i] for i in decode_seqs], decode_seqs, directions, scale, out):
        decode_seqs = []
    decode_blocks = {i: -(-lens[i] // block_size) for i in decode_seqs}
    for seqs in decode_groups(decode_blocks, GROUP_RATIO):  # read now: tests sweep it
        n_blocks = decode_blocks[seqs[-1]]
        index = torch.tensor(seqs, device=q.device)
        keys, values = gathered(index, n_blocks)
        rows = torch.tensor([starts[i] for i in seqs], device=q.device)
        queries = q[rows].view(len(seqs), num_kv_heads, num_heads // num_kv_heads, head_dim)
        mask = torch.arange(n_blocks * block_size, device=q.device) < seq_lens[index].unsqueeze(1)  # [S, keys]
        attn = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask[:, None, None, :], scale=scale)
        out[rows] = attn.reshape(len(seqs), num_heads, head_dim)

    for i in range(len(lens)):
        first, end = starts[i], starts[i + 1]
        q_len, context = end - first, lens[i]
        if q_len <= 1:
            continue
        keys, values = gathered(slice(i, i + 1), -(-context // block_size))
        keys, values = keys[:, :, :context], values[:, :, :context]
        queries = q[first:end].unsqueeze(0).transpose(1, 2)  # [1, H, n, D]
        if q_len == context:  # the whole context is this chunk: plain causal attention
            attn = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        else:  # query j sits at position context - q_len + j and sees keys up to it
            positions = context - q_len + torch.arange(q_len, device=q.device)
            mask = torch.arange(context, device=q.device) <= positions.unsqueeze(1)
            attn = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        out[first:end] = attn.transpose(1, 2).reshape(q_len, num_heads, head_dim)
    return out
