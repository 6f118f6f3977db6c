"""The Triton kernels against nanoserve/kernels/reference.py: under TRITON_INTERPRET=1 on the CPU (CI),
compiled on CUDA when a GPU is present. Cases are kept small because the interpreter runs each
program in NumPy."""
from __future__ import annotations

import os

import pytest
import torch
from attention_cases import TOLERANCE, CaseSpec, SeqSpec, build_case, case_specs
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.kernels import reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from nanoserve.kernels.paged_attention import paged_attention  # noqa: E402  (after the interpreter check)
from nanoserve.kernels.store_kv import store_kv  # noqa: E402

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def run_both(case):
    """Store this step's K/V and attend, once with Triton and once with the reference."""
    k_tri, v_tri = case.k_cache.clone(), case.v_cache.clone()
    store_kv(case.new_k, case.new_v, k_tri, v_tri, case.slot_mapping)
    k_ref, v_ref = case.k_cache.clone(), case.v_cache.clone()
    reference.store_kv(case.new_k, case.new_v, k_ref, v_ref, case.slot_mapping)
    assert torch.equal(k_tri, k_ref) and torch.equal(v_tri, v_ref)
    return paged_attention(*case.attention_args(k_tri, v_tri)), reference.paged_attention(
        *case.attention_args(k_ref, v_ref))


def assert_matches(case, out, ref):
    tol = TOLERANCE[case.spec.dtype]
    assert out.dtype == case.q.dtype and out.shape == case.q.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(out.double().cpu(), case.expected, atol=tol, rtol=tol)


@settings(max_examples=150, deadline=None)
@given(case_specs(dtypes=DTYPES, max_len=80, max_seqs=3), st.integers(0, 2**31 - 1))
def test_triton_matches_reference(spec, seed):
    case = build_case(spec, seed, DEVICE)
    assert_matches(case, *run_both(case))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rt_and_be_share_a_page_and_each_reads_only_its_own_tokens(dtype):
    """BROS §5.1: sequence 0 fills its last page 0..4 from the left, sequence 1 fills the same
    page 15..9 from the right; the other slots of that page hold noise."""
    spec = CaseSpec(block_size=16, num_kv_heads=2, group=4, head_dim=64, dtype=dtype,
                    seqs=(SeqSpec(16 + 5, 1, False), SeqSpec(7, 7, True), SeqSpec(40, 3, True)),
                    with_directions=True, shared_pairs=((0, 1),))
    case = build_case(spec, seed=7, device=DEVICE)
    assert case.block_tables[0, 1] == case.block_tables[1, 0]
    assert_matches(case, *run_both(case))
    case.directions = case.directions.to(torch.int8)  # the issue allows bool or int8 flags
    assert_matches(case, *run_both(case))


@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", [(64, 9, 3), (128, 32, 8), (64, 4, 4)])
def test_decode_batch_shapes(head_dim, num_heads, num_kv_heads):
    """SmolLM2's 9/3 heads, a Llama-3-8B layer's 32/8, and plain multi-head attention."""
    spec = CaseSpec(block_size=16, num_kv_heads=num_kv_heads, group=num_heads // num_kv_heads,
                    head_dim=head_dim, dtype=torch.float16,
                    seqs=tuple(SeqSpec(n, 1, False) for n in (1, 16, 17, 70)), with_directions=False)
    case = build_case(spec, seed=3, device=DEVICE)
    assert_matches(case, *run_both(case))


def test_padding_rows_are_skipped_and_empty_batches_return():
    k_cache = torch.zeros(2, 8, 1, 16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    key = torch.ones(3, 1, 16, device=DEVICE)
    store_kv(key, key * 2, k_cache, v_cache, torch.tensor([9, -1, 0], device=DEVICE))
    assert k_cache.view(-1, 16)[9].eq(1).all() and v_cache.view(-1, 16)[0].eq(2).all()
    assert k_cache.view(-1, 16).ne(0).any(1).sum() == 2
    empty = torch.empty(0, 2, 16, device=DEVICE)
    out = paged_attention(empty, k_cache, v_cache, torch.empty(0, 1, dtype=torch.int32, device=DEVICE),
                          torch.empty(0, dtype=torch.int32, device=DEVICE),
                          torch.zeros(1, dtype=torch.int32, device=DEVICE), None, 0.25)
    assert out.shape == (0, 2, 16)


@settings(max_examples=60, deadline=None)
@given(case_specs(dtypes=DTYPES, max_len=80, max_seqs=3).filter(lambda s: all(q.new == 1 for q in s.seqs)),
       st.sampled_from([2, 3, 7, 32]), st.sampled_from([0, 32, 256]), st.integers(0, 2**31 - 1))
def test_split_decode_matches_reference(spec, splits, min_split, seed):
    """Flash-decoding: each context cut into `splits` parts of at least `min_split` positions
    (some empty for short contexts), combined by their log-sum-exp; BROS directions and shared
    pages included."""
    case = build_case(spec, seed, DEVICE)
    reference.store_kv(case.new_k, case.new_v, case.k_cache, case.v_cache, case.slot_mapping)
    ref = reference.paged_attention(*case.attention_args(case.k_cache, case.v_cache))
    out = paged_attention(*case.attention_args(case.k_cache, case.v_cache), num_splits=splits,
                          min_split_tokens=min_split)
    assert_matches(case, out, ref)


@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", [(64, 9, 3), (128, 32, 8)])
def test_split_decode_long_contexts(head_dim, num_heads, num_kv_heads):
    spec = CaseSpec(block_size=16, num_kv_heads=num_kv_heads, group=num_heads // num_kv_heads,
                    head_dim=head_dim, dtype=torch.float16,
                    seqs=tuple(SeqSpec(n, 1, False) for n in (1, 33, 300)), with_directions=False)
    case = build_case(spec, seed=11, device=DEVICE)
    reference.store_kv(case.new_k, case.new_v, case.k_cache, case.v_cache, case.slot_mapping)
    ref = reference.paged_attention(*case.attention_args(case.k_cache, case.v_cache))
    for splits, min_split in ((1, 0), (4, 0), (5, 0), (5, 64), (4, 256)):  # 256: the 300-token context in 2
        out = paged_attention(*case.attention_args(case.k_cache, case.v_cache), num_splits=splits,
                              min_split_tokens=min_split)
        assert_matches(case, out, ref)
