"""Plain PyTorch paged attention and KV store: the semantics every Triton kernel must match.

Cache layout: k_cache, v_cache are [num_blocks, block_size, num_kv_heads, head_dim]. A
sequence's token at position p lives in block `block_tables[s, p // B]`, at slot `p % B`, or
at slot `B - 1 - p % B` when `directions[s]` is true (BROS's right-to-left blocks).

The batch is flat: q holds every sequence's new tokens back to back, sequence s owning rows
`query_start_loc[s]:query_start_loc[s+1]`; its new tokens are the last ones of its
`seq_lens[s]` context tokens. Each new token attends causally to every position up to its own.

Decode rows (one new token) are batched into one SDPA call over their gathered, padded
contexts; prefill chunks run one sequence at a time. Both compute the same thing; the split
only keeps the CPU path fast for the common continuous-batching step (many decodes, a few
chunks).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int [num_tokens]: block * block_size + slot; < 0 means skip
) -> None:
    """Write each new token's K/V to its slot. Direction is already folded into the slot."""
    num_blocks, block_size = k_cache.shape[:2]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    k_cache.view(num_blocks * block_size, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key)
    v_cache.view(num_blocks * block_size, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value)


def gather_kv(
    cache: torch.Tensor,
    block_tables: torch.Tensor,  # int [num_seqs, max_blocks]
    directions: torch.Tensor | None,
) -> torch.Tensor:
    """[num_seqs, max_blocks * block_size, num_kv_heads, head_dim] in position order."""
    s, m = block_tables.shape
    blocks = cache.index_select(0, block_tables.reshape(-1).long()).view(s, m, *cache.shape[1:])
    if directions is not None and bool(directions.any()):
        flip = directions.bool().view(-1, 1, 1, 1, 1)
        blocks = torch.where(flip, blocks.flip(2), blocks)
    return blocks.view(s, m * cache.shape[1], *cache.shape[2:])


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor,  # int32 [num_seqs]
    query_start_loc: torch.Tensor,  # int32 [num_seqs + 1]
    directions: torch.Tensor | None,  # bool [num_seqs] or None
    scale: float,
) -> torch.Tensor:
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [starts[i + 1] - starts[i] for i in range(len(lens))]

    def attend(rows: torch.Tensor, seqs: list[int], q_len: int) -> None:
        """SDPA for `seqs`, each with `q_len` new tokens, over their gathered contexts.

        Query j of a sequence of length L sits at position L - q_len + j and sees keys at
        positions up to its own; that one rule is the causal mask of a chunk and, for a decode,
        masks the padding past the sequence's end.
        """
        idx = torch.tensor(seqs, device=q.device)
        n_blocks = -(-max(lens[i] for i in seqs) // block_size)
        dirs = directions[idx] if directions is not None else None
        # [S, L, Hkv, D] -> [S, Hkv, L, D] as a view: SDPA reads the strides, no extra copy.
        keys = gather_kv(k_cache, block_tables[idx, :n_blocks], dirs).transpose(1, 2)
        values = gather_kv(v_cache, block_tables[idx, :n_blocks], dirs).transpose(1, 2)
        positions = seq_lens[idx].unsqueeze(1) - q_len + torch.arange(q_len, device=q.device)  # [S, n]
        mask = torch.arange(keys.shape[2], device=q.device) <= positions.unsqueeze(2)  # [S, n, keys]
        queries = q[rows].view(len(seqs), q_len, *q.shape[1:]).transpose(1, 2)  # [S, H, n, D]
        attn = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask.unsqueeze(1), scale=scale,
                                              enable_gqa=True)
        out[rows] = attn.transpose(1, 2).reshape(-1, *q.shape[1:])

    # Decodes: one query each, batched into one call.
    decode = [i for i, n in enumerate(q_lens) if n == 1]
    if decode:
        attend(torch.tensor([starts[i] for i in decode], device=q.device), decode, 1)

    # Prefill chunks, one sequence at a time.
    for i, n in enumerate(q_lens):
        if n > 1:
            attend(torch.arange(starts[i], starts[i + 1], device=q.device), [i], n)
    return out
