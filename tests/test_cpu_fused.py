"""nanoserve/kernels/cpu_fused.py (the layer's elementwise ops in C) against the PyTorch references in
nanoserve/kernels/fused_ops.py: fp32 to rounding, bf16 to two units in the last place (the mean's sum runs
in another order, which can flip the rounding of the normalised value by one unit before the
weight multiplies it and the product rounds again), the residual sum exactly. Shapes include
SmolLM2's odd widths (576 hidden, 9 heads, 1536 MLP), q and k as strided views of one qkv row,
and row counts on both sides of the kernels' one-thread / OpenMP cut. fp16 has no C path: it
must run the reference."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.kernels import cpu_fused
from nanoserve.kernels.fused_ops import (
    add_rms_norm_reference,
    rms_norm_reference,
    rope_reference,
    silu_and_mul_reference,
)

pytestmark = pytest.mark.skipif(cpu_fused.cpu_fused_ops() is None,
                                reason="the C layer ops did not build here (no C compiler?)")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ROWS = st.one_of(st.integers(0, 9), st.sampled_from([200, 513]))  # 200 x 576 and up: the parallel path


def close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:
        ulp = {torch.bfloat16: 2 * 2**-7, torch.float16: 2**-10}[out.dtype]
        torch.testing.assert_close(out.float(), ref.float(), atol=1e-3, rtol=ulp)


def data(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 2).to(dtype)


@settings(max_examples=40, deadline=None)
@given(ROWS, st.sampled_from([64, 576, 1000]), st.sampled_from(DTYPES), st.integers(0, 1000))
def test_rms_norm_and_add_rms_norm(rows, cols, dtype, seed):
    x, r = data(rows, cols, dtype=dtype, seed=seed), data(rows, cols, dtype=dtype, seed=seed + 1)
    w = data(cols, dtype=dtype, seed=seed + 2)
    close(cpu_fused.rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5))
    out, summed = cpu_fused.add_rms_norm(x, r, w, 1e-6)
    ref_out, ref_summed = add_rms_norm_reference(x, r, w, 1e-6)
    assert torch.equal(summed, ref_summed)  # one rounded add, as PyTorch's
    close(out, ref_out)


@settings(max_examples=40, deadline=None)
@given(ROWS, st.sampled_from([(9, 3, 64), (4, 4, 32), (8, 2, 128)]), st.sampled_from(DTYPES), st.integers(0, 1000))
def test_rope_of_strided_q_and_k(tokens, heads, dtype, seed):
    q_heads, k_heads, dim = heads
    qkv = data(tokens, (q_heads + 2 * k_heads) * dim, dtype=dtype, seed=seed)
    q = qkv[:, : q_heads * dim].view(tokens, q_heads, dim)  # views into one row, as the model has them
    k = qkv[:, q_heads * dim : (q_heads + k_heads) * dim].view(tokens, k_heads, dim)
    angles = torch.arange(tokens).float()[:, None] * torch.rand(dim // 2, generator=torch.Generator().manual_seed(seed))
    q_out, k_out = cpu_fused.rope(q, k, angles.cos(), angles.sin())
    q_ref, k_ref = rope_reference(q, k, angles.cos(), angles.sin())
    assert q_out.is_contiguous() and k_out.is_contiguous()
    close(q_out, q_ref)
    close(k_out, k_ref)


@settings(max_examples=40, deadline=None)
@given(ROWS, st.sampled_from([8, 1536, 3000]), st.sampled_from(DTYPES), st.integers(0, 1000))
def test_silu_and_mul(rows, cols, dtype, seed):
    gate_up = data(rows, 2 * cols, dtype=dtype, seed=seed) * 8  # into SiLU's tails: e^-x large and small
    close(cpu_fused.silu_and_mul(gate_up), silu_and_mul_reference(gate_up))


def test_a_layer_on_the_c_ops_keeps_greedy_output(smollm2_dir):
    """SmolLM2 through the torch backend with the C ops and with PyTorch's ops (the A/B switch
    `fused_layer_ops`): the same greedy tokens, fp32 (near-ties aside, as tests/mixed_greedy.py)."""
    from nanoserve import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    outputs = {}
    for fused in (True, False):
        with LLM(str(smollm2_dir), device="cpu", dtype="float32", kv_cache_tokens=2048, max_model_len=256,
                 fused_layer_ops=fused) as llm:
            assert (llm.engine.executor.backend.fused is not None) == fused
            outputs[fused] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outputs[True] == outputs[False]
