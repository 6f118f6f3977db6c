"""kernels/reference.py against dense causal softmax attention over K/V laid out by hand."""
from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.reference import paged_attention, store_kv


def dense_attention(q, k, v, scale):
    """q: [n, H, D] for the last n positions; k, v: [L, Hkv, D]; causal; GQA by repetition."""
    n, heads, _ = q.shape
    length, kv_heads, _ = k.shape
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k.double()) * scale
    positions = torch.arange(length - n, length)
    scores = scores.masked_fill(torch.arange(length)[None, None, :] > positions[None, :, None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v.double())


@st.composite
def batches(draw):
    block_size = draw(st.sampled_from([1, 4, 8, 16]))
    kv_heads = draw(st.sampled_from([1, 2]))
    heads = kv_heads * draw(st.sampled_from([1, 3]))
    head_dim = draw(st.sampled_from([4, 8]))
    num_seqs = draw(st.integers(1, 5))
    seqs = []
    for _ in range(num_seqs):
        length = draw(st.integers(1, 40))
        new = draw(st.one_of(st.just(1), st.integers(1, length)))  # decode or a chunk with prefix
        seqs.append((length, new, draw(st.booleans())))
    return block_size, heads, kv_heads, head_dim, seqs, draw(st.booleans())


@settings(max_examples=120, deadline=None)
@given(batches(), st.integers(0, 2**31 - 1))
def test_reference_matches_dense_attention(case, seed):
    block_size, heads, kv_heads, head_dim, seqs, use_directions = case
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(math.ceil(length / block_size) for length, _, _ in seqs)
    num_blocks = max_blocks * len(seqs) + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)  # garbage elsewhere
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()  # blocks scattered through the cache

    tables, q_parts, expected, qsl = [], [], [], [0]
    slots = []
    for s, (length, new, right_to_left) in enumerate(seqs):
        rtl = use_directions and right_to_left
        table = [perm.pop() for _ in range(math.ceil(length / block_size))]
        tables.append(table + [0] * (max_blocks - len(table)))
        k = torch.randn(length, kv_heads, head_dim, generator=g)
        v = torch.randn(length, kv_heads, head_dim, generator=g)
        for p in range(length):
            slot = block_size - 1 - p % block_size if rtl else p % block_size
            flat = table[p // block_size] * block_size + slot
            if p < length - new:  # the prefix is already cached; new tokens go through store_kv
                k_cache.view(-1, kv_heads, head_dim)[flat] = k[p]
                v_cache.view(-1, kv_heads, head_dim)[flat] = v[p]
            else:
                slots.append(flat)
        q = torch.randn(new, heads, head_dim, generator=g)
        q_parts.append(q)
        expected.append(dense_attention(q, k, v, head_dim**-0.5))
        qsl.append(qsl[-1] + new)
        new_k, new_v = k[length - new:], v[length - new:]
        store_kv(new_k, new_v, k_cache, v_cache, torch.tensor(slots[-new:]))

    directions = torch.tensor([use_directions and r for _, _, r in seqs]) if use_directions else None
    out = paged_attention(
        torch.cat(q_parts), k_cache, v_cache, torch.tensor(tables, dtype=torch.int32),
        torch.tensor([length for length, _, _ in seqs], dtype=torch.int32),
        torch.tensor(qsl, dtype=torch.int32), directions, head_dim**-0.5,
    )
    torch.testing.assert_close(out.double(), torch.cat(expected), atol=1e-5, rtol=1e-5)


def test_store_kv_skips_negative_slots():
    k_cache = torch.zeros(2, 4, 1, 2)
    v_cache = torch.zeros(2, 4, 1, 2)
    key = torch.ones(3, 1, 2)
    store_kv(key, key * 2, k_cache, v_cache, torch.tensor([5, -1, 0]))
    assert k_cache.view(-1, 2)[5].eq(1).all() and k_cache.view(-1, 2)[0].eq(1).all()
    assert k_cache.view(-1, 2).abs().sum() == 4  # exactly two slots written
    assert v_cache.view(-1, 2)[5].eq(2).all()
