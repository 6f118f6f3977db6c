"""kernels/cpu_attention.py (the torch backend's paged attention) against kernels/reference.py
and dense attention: grouping decode rows by length, folding query heads onto their KV head and
the causal first chunk must change nothing but the memory traffic."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attention_cases import TOLERANCE, build_case, case_specs
from kernels import cpu_attention, reference

# Short blocks and many rows so that the decode rows fall in several length groups.
SPECS = case_specs(block_sizes=(1, 2, 4, 8), head_dims=(4, 8), groups=(1, 3),
                   dtypes=(torch.float32, torch.bfloat16), max_len=48, max_seqs=8)


@settings(max_examples=200, deadline=None)
@given(SPECS, st.integers(0, 2**31 - 1), st.sampled_from([1.0, 1.5, 2.0, 100.0]))
def test_cpu_attention_matches_reference(spec, seed, ratio):
    case = build_case(spec, seed)
    reference.store_kv(case.new_k, case.new_v, case.k_cache, case.v_cache, case.slot_mapping)
    args = case.attention_args(case.k_cache, case.v_cache)
    saved, cpu_attention.GROUP_RATIO = cpu_attention.GROUP_RATIO, ratio
    try:
        out = cpu_attention.paged_attention(*args)
    finally:
        cpu_attention.GROUP_RATIO = saved
    tol = TOLERANCE[spec.dtype]
    assert out.dtype == case.q.dtype and out.shape == case.q.shape
    torch.testing.assert_close(out.float(), reference.paged_attention(*args).float(), atol=tol, rtol=tol)
    torch.testing.assert_close(out.double(), case.expected, atol=tol, rtol=tol)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.integers(0, 40), st.integers(1, 64), max_size=30), st.floats(1.0, 4.0))
def test_decode_groups_partition_rows_and_bound_the_padding(blocks, ratio):
    groups = cpu_attention.decode_groups(blocks, ratio)
    assert sorted(row for group in groups for row in group) == sorted(blocks)
    sizes = [[blocks[row] for row in group] for group in groups]
    for group in sizes:
        assert group == sorted(group) and group[-1] <= ratio * group[0]
    for before, after in zip(sizes, sizes[1:]):  # a cut only where the next row would pass the bound
        assert after[0] > ratio * before[0] and before[-1] <= after[0]
