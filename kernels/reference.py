"""Plain PyTorch paged attention and KV store: the semantics every Triton kernel must match.

Cache layout: k_cache, v_cache are [num_blocks, block_size, num_kv_heads, head_dim]. A
sequence's token at position p lives in block `block_tables[s, p // B]`, at slot `p % B`, or
at slot `B - 1 - p % B` when `directions[s]` is true (BROS's right-to-left blocks).

The batch is flat: q holds every sequence's new tokens back to back, sequence s owning rows
`query_start_loc[s]:query_start_loc[s+1]`; its new tokens are the last ones of its
`seq_lens[s]` context tokens. Each new token attends causally to every position up to its own.

Decode-only rows (one new token) are batched into a single padded matmul; prefill chunks run
one sequence at a time through SDPA. Both compute the same thing; the split only keeps the CPU
path fast for the common continuous-batching step (many decodes, a few chunks).
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
    blocks = cache[block_tables.long()]  # [S, M, B, H, D]
    if directions is not None and bool(directions.any()):
        flip = directions.bool().view(-1, 1, 1, 1, 1)
        blocks = torch.where(flip, blocks.flip(2), blocks)
    s, m, b = blocks.shape[:3]
    return blocks.reshape(s, m * b, *blocks.shape[3:])


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
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [starts[i + 1] - starts[i] for i in range(len(lens))]

    decode = [i for i, n in enumerate(q_lens) if n == 1]
    if decode:
        idx = torch.tensor(decode, device=q.device)
        max_len = max(lens[i] for i in decode)
        n_blocks = -(-max_len // k_cache.shape[1])
        tables = block_tables[idx, :n_blocks]
        dirs = directions[idx] if directions is not None else None
        keys = gather_kv(k_cache, tables, dirs)[:, :max_len]  # [S, L, Hkv, D]
        values = gather_kv(v_cache, tables, dirs)[:, :max_len]
        rows = torch.tensor([starts[i] for i in decode], device=q.device)
        qd = q[rows].view(len(decode), num_kv_heads, group, head_dim)
        # scores: [S, Hkv, G, L]
        scores = torch.einsum("shgd,slhd->shgl", qd.float(), keys.float()) * scale
        valid = torch.arange(max_len, device=q.device) < seq_lens[idx].unsqueeze(1)
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        probs = scores.softmax(dim=-1)
        attn = torch.einsum("shgl,slhd->shgd", probs, values.float())
        out[rows] = attn.reshape(len(decode), num_heads, head_dim).to(q.dtype)

    for i, n in enumerate(q_lens):
        if n <= 1:
            continue
        length = lens[i]
        n_blocks = -(-length // k_cache.shape[1])
        tables = block_tables[i : i + 1, :n_blocks]
        dirs = directions[i : i + 1] if directions is not None else None
        keys = gather_kv(k_cache, tables, dirs)[0, :length]  # [L, Hkv, D]
        values = gather_kv(v_cache, tables, dirs)[0, :length]
        # New token j (0-based within the chunk) sits at position length - n + j.
        positions = torch.arange(length - n, length, device=q.device)
        mask = torch.arange(length, device=q.device)[None, :] <= positions[:, None]  # [n, L]
        qs = q[starts[i] : starts[i + 1]].transpose(0, 1).float()  # [H, n, D]
        ks = keys.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
        vs = values.float().repeat_interleave(group, dim=1).transpose(0, 1)
        attn = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
        out[starts[i] : starts[i + 1]] = attn.transpose(0, 1).to(q.dtype)
    return out
