# Triton kernel bodies (@triton.jit) take untyped pointer and tl.constexpr parameters; the launchers are typed.
# mypy: disable-error-code="no-untyped-def"
"""Write this step's K/V into the paged cache through the slot mapping, in Triton.

`slot_mapping[t] = page * B + slot` names the cache slot of new token t; a negative entry
means "do not write" (a padding row). The memory manager folds the direction into the slot
(`B - 1 - p % B` for a right-to-left BROS sequence), so this kernel knows nothing of
directions. The reference is `nanoserve/kernels/reference.store_kv`; this module re-exports it as
`store_kv_reference` so the pair is found together.

One program copies one token's K and V rows: [num_kv_heads, head_dim] each, contiguous in the
cache, so the copy is a single coalesced load and store per tensor.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.kernels.reference import store_kv as store_kv_reference

__all__ = ["store_kv", "store_kv_reference"]


@triton.jit
def _store_kv_kernel(
    key, value, k_cache, v_cache, slot_mapping,
    stride_key_tok, stride_key_head, stride_value_tok, stride_value_head,
    stride_k_block, stride_k_slot, stride_k_head,
    stride_v_block, stride_v_slot, stride_v_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    if slot < 0:
        return
    page = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_DIM_PAD)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)

    k = tl.load(key + token * stride_key_tok + heads * stride_key_head + dims, mask=mask)
    tl.store(k_cache + page * stride_k_block + offset * stride_k_slot + heads * stride_k_head + dims, k, mask=mask)
    v = tl.load(value + token * stride_value_tok + heads * stride_value_head + dims, mask=mask)
    tl.store(v_cache + page * stride_v_block + offset * stride_v_slot + heads * stride_v_head + dims, v, mask=mask)


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int [num_tokens]: page * block_size + slot; < 0 means skip
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(2) != 1:
        key = key.contiguous()
    if value.stride(2) != 1:
        value = value.contiguous()
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("the KV cache's head_dim must be contiguous")
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
    )
