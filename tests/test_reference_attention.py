"""nanoserve/kernels/reference.py against dense causal softmax attention over K/V laid out by hand."""
from __future__ import annotations

import torch
from attention_cases import TOLERANCE, build_case, case_specs
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.kernels.reference import paged_attention, store_kv

SPECS = case_specs(block_sizes=(1, 4, 8, 16), head_dims=(4, 8), groups=(1, 3),
                   dtypes=(torch.float32, torch.float16, torch.bfloat16), max_len=40, max_seqs=5)


@settings(max_examples=150, deadline=None)
@given(SPECS, st.integers(0, 2**31 - 1))
def test_reference_matches_dense_attention(spec, seed):
    case = build_case(spec, seed)
    store_kv(case.new_k, case.new_v, case.k_cache, case.v_cache, case.slot_mapping)
    out = paged_attention(*case.attention_args(case.k_cache, case.v_cache))
    tol = TOLERANCE[spec.dtype]
    torch.testing.assert_close(out.double(), case.expected, atol=tol, rtol=tol)


def test_store_kv_skips_negative_slots():
    k_cache = torch.zeros(2, 4, 1, 2)
    v_cache = torch.zeros(2, 4, 1, 2)
    key = torch.ones(3, 1, 2)
    store_kv(key, key * 2, k_cache, v_cache, torch.tensor([5, -1, 0]))
    assert k_cache.view(-1, 2)[5].eq(1).all() and k_cache.view(-1, 2)[0].eq(1).all()
    assert k_cache.view(-1, 2).abs().sum() == 4  # exactly two slots written
    assert v_cache.view(-1, 2)[5].eq(2).all()
