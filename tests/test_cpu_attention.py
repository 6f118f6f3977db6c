"""nanoserve/kernels/cpu_attention.py (the torch backend's paged attention) against nanoserve/kernels/reference.py
and dense attention: grouping decode rows by length, folding query heads onto their KV head,
the causal first chunk and the C decode kernel (nanoserve/kernels/cpu_decode_attention.py) must change
nothing but the memory traffic. Each case runs on both decode paths: the C kernel's (where it
builds) and the gathered SDPA's it replaces."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from attention_cases import TOLERANCE, build_case, case_specs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanoserve.kernels import cpu_attention, cpu_build, cpu_decode_attention, reference

needs_c_kernel = pytest.mark.skipif(not cpu_decode_attention.available(),
                                    reason="the C decode kernel did not build here (no C compiler?)")

# Short blocks and many rows so that the decode rows fall in several length groups.
SPECS = case_specs(block_sizes=(1, 2, 4, 8), head_dims=(4, 8), groups=(1, 3),
                   dtypes=(torch.float32, torch.bfloat16), max_len=48, max_seqs=8)


@pytest.fixture(params=["c_kernel", "gathered_sdpa"])
def decode_path(request, monkeypatch):
    """Which path the decode rows take: the C kernel, or (the kernel refusing) the SDPA one."""
    if request.param == "c_kernel":
        if not cpu_decode_attention.available():
            pytest.skip("the C decode kernel did not build here (no C compiler?)")
    else:
        monkeypatch.setattr(cpu_decode_attention, "decode_attention", lambda *args: False)
    return request.param


# The fixture's patch holds for every example alike: nothing to reset between them.
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=SPECS, seed=st.integers(0, 2**31 - 1), ratio=st.sampled_from([1.0, 1.5, 2.0, 100.0]))
def test_cpu_attention_matches_reference(decode_path, spec, seed, ratio):
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


@needs_c_kernel
def test_c_kernel_computes_only_the_rows_it_is_given():
    """Decode rows in any order, mapped to their sequences; the other rows are left alone."""
    torch.manual_seed(0)
    blocks, size, kv_heads, heads, dim = 12, 4, 2, 6, 16
    k_cache, v_cache = torch.randn(blocks, size, kv_heads, dim), torch.randn(blocks, size, kv_heads, dim)
    tables = torch.tensor([[3, 7, 1], [0, 2, 5], [11, 9, 4]], dtype=torch.int32)
    seq_lens = torch.tensor([10, 3, 12], dtype=torch.int32)
    q = torch.randn(3, heads, dim)
    out = torch.full_like(q, 7.0)
    assert cpu_decode_attention.decode_attention(q, k_cache, v_cache, tables, seq_lens, [2, 0], [2, 0], None,
                                                 0.25, out)
    expected = reference.paged_attention(q, k_cache, v_cache, tables, seq_lens,
                                         torch.arange(4, dtype=torch.int32), None, 0.25)
    torch.testing.assert_close(out[[0, 2]], expected[[0, 2]], atol=2e-5, rtol=2e-5)
    assert bool((out[1] == 7.0).all())


@needs_c_kernel
def test_c_kernel_refuses_what_it_does_not_read():
    """Another dtype or a non-contiguous cache: False and nothing written, for the caller's path."""
    q = torch.randn(1, 2, 8, dtype=torch.float64)
    cache = torch.randn(2, 4, 1, 8, dtype=torch.float64)
    args = (torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), [0], [0], None, 1.0)
    assert not cpu_decode_attention.decode_attention(q, cache, cache, *args[:4], *args[4:], torch.zeros_like(q))
    q32, strided = torch.randn(1, 2, 8), torch.randn(2, 4, 2, 8)[:, :, :1]
    assert not cpu_decode_attention.decode_attention(q32, strided, strided, *args[:4], *args[4:], torch.zeros_like(q32))


@needs_c_kernel
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps (Linux)")
def test_c_kernel_shares_torchs_openmp_runtime():
    """The kernel's parallel regions must run on PyTorch's libgomp, not a second copy with its
    own thread pools (nanoserve/async_engine.py says what two pools cost): one libgomp mapped."""
    cpu_decode_attention.available()
    loaded = cpu_build.loaded_libgomps()
    assert len(loaded) == 1, loaded


def test_c_kernel_can_be_turned_off(monkeypatch):
    monkeypatch.setenv(cpu_build.DISABLE_ENV, "0")
    cpu_decode_attention._library.cache_clear()
    try:
        assert not cpu_decode_attention.available()
    finally:
        monkeypatch.delenv(cpu_build.DISABLE_ENV)
        cpu_decode_attention._library.cache_clear()
    assert cpu_decode_attention.available() == (os.environ.get(cpu_build.DISABLE_ENV) != "0"
                                                and cpu_build.compiler() is not None)


@needs_c_kernel
def test_c_kernel_built_without_openmp_computes_the_same(monkeypatch, tmp_path):
    """Where torch has no libgomp, the kernel is built without OpenMP (one thread) instead of
    bringing a second runtime: it must still compute the reference's attention."""
    monkeypatch.setattr(cpu_build, "torch_libgomp", lambda: None)
    monkeypatch.setenv(cpu_build.CACHE_ENV, str(tmp_path))
    library = cpu_decode_attention._library.__wrapped__()  # a fresh build, not the cached one
    assert library is not None and list(tmp_path.glob("*.so"))
    monkeypatch.setattr(cpu_decode_attention, "_library", lambda: library)
    test_c_kernel_computes_only_the_rows_it_is_given()


def shared_prefix_cache(lens: list[int], shared: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V caches and block tables where every sequence's table starts with the same
    `shared` blocks (a cached prefix), its other blocks its own."""
    blocks = [-(-n // block_size) for n in lens]
    num_blocks = shared + sum(b - shared for b in blocks) + 1
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    free = iter(range(shared, num_blocks))
    for i, b in enumerate(blocks):
        tables[i, :shared] = torch.arange(shared)
        tables[i, shared:b] = torch.tensor([next(free) for _ in range(b - shared)], dtype=torch.int32)
    return k_cache, v_cache, tables


@contextlib.contextmanager
def counting_cascade(name: str, **thresholds: int) -> Iterator[list[int]]:
    """Lower the cascade thresholds (`CASCADE_*` of cpu_attention) and record the shared blocks
    of every call to `cpu_attention.<name>` (cascade_decode or cascade_prefill)."""
    saved = {key: getattr(cpu_attention, key) for key in [*thresholds, name]}
    calls: list[int] = []

    def counted(*args, **kwargs):
        calls.append(args[7])  # the shared blocks
        return saved[name](*args, **kwargs)

    for key, value in {**thresholds, name: counted}.items():
        setattr(cpu_attention, key, value)
    try:
        yield calls
    finally:
        for key, value in saved.items():
            setattr(cpu_attention, key, value)


@needs_c_kernel
@settings(max_examples=60, deadline=None)
@given(num_rows=st.integers(8, 20), shared=st.integers(1, 6), own=st.lists(st.integers(1, 30), min_size=20,
                                                                            max_size=20),
       group=st.sampled_from([1, 3]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2**31 - 1))
def test_cascade_decode_matches_the_reference(num_rows, shared, own, group, dtype, seed):
    """Decode rows whose tables begin with the same blocks (a cached prefix): the shared part by
    flash attention, each row's rest by the C kernel, merged by log-sum-exp, equal the reference."""
    g = torch.Generator().manual_seed(seed)
    B, Hkv, D = 4, 2, 8
    H = Hkv * group
    lens = [shared * B + own[i] for i in range(num_rows)]
    k_cache, v_cache, tables = shared_prefix_cache(lens, shared, B, Hkv, D, dtype, g)
    q = torch.randn(num_rows, H, D, generator=g).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    starts = torch.arange(num_rows + 1, dtype=torch.int32)
    assert cpu_attention.common_prefix_blocks(tables, list(range(num_rows)), lens, B) >= shared
    with counting_cascade("cascade_decode", CASCADE_MIN_ROWS=8, CASCADE_MIN_TOKENS=1) as calls:
        out = cpu_attention.paged_attention(q, k_cache, v_cache, tables, seq_lens, starts, None, D ** -0.5)
    assert calls and calls[0] >= shared
    expected = reference.paged_attention(q, k_cache, v_cache, tables, seq_lens, starts, None, D ** -0.5)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@settings(max_examples=60, deadline=None)
@given(num_chunks=st.integers(4, 8), shared=st.integers(1, 5), earlier=st.lists(st.integers(0, 9), min_size=8,
                                                                                max_size=8),
       q_lens=st.lists(st.integers(2, 9), min_size=8, max_size=8), group=st.sampled_from([1, 3]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**31 - 1))
def test_cascade_prefill_matches_the_reference(num_chunks, shared, earlier, q_lens, group, dtype, seed):
    """Prompt chunks past a shared cached prefix (some after earlier chunks of their own): the
    shared keys in one call for every chunk, each chunk's own keys causally, merged, equal the
    reference; a decode row in the same batch is untouched by it."""
    g = torch.Generator().manual_seed(seed)
    B, Hkv, D = 4, 2, 8
    H = Hkv * group
    lens = [shared * B + earlier[i] + q_lens[i] for i in range(num_chunks)] + [shared * B + 3]
    chunk = q_lens[:num_chunks] + [1]
    k_cache, v_cache, tables = shared_prefix_cache(lens, shared, B, Hkv, D, dtype, g)
    starts = torch.tensor([0] + list(torch.tensor(chunk).cumsum(0)), dtype=torch.int32)
    q = torch.randn(int(starts[-1]), H, D, generator=g).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    with counting_cascade("cascade_prefill", CASCADE_MIN_CHUNKS=4, CASCADE_MIN_TOKENS=1) as calls:
        out = cpu_attention.paged_attention(q, k_cache, v_cache, tables, seq_lens, starts, None, D ** -0.5)
    assert calls == [shared]
    expected = reference.paged_attention(q, k_cache, v_cache, tables, seq_lens, starts, None, D ** -0.5)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
