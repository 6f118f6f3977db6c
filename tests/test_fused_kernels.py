"""nanoserve/kernels/fused.py against its PyTorch references: under TRITON_INTERPRET=1 on a CPU (CI),
compiled on a GPU. Shapes include SmolLM2's odd widths (576 hidden, 9 heads, 1536 MLP)."""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from nanoserve.kernels import fused  # noqa: E402  (after the interpreter check)
from nanoserve.kernels.fused_ops import (  # noqa: E402
    add_rms_norm_reference,
    rms_norm_reference,
    rope_reference,
    silu_and_mul_reference,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# Triton's interpreter rounds to bf16 by truncation (a compiled kernel rounds to nearest), so an
# interpreted bf16 result that rounds three times (sum, norm, product) may be up to four units in
# the last place off.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
ULPS = {torch.float16: 2**-10, torch.bfloat16: 2**-7 * (4 if INTERPRETED else 1)}


def close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32: to rounding; half types: a unit in the last place of the result (bf16
    under the interpreter: four)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(out.float(), ref.float(), atol=1e-3, rtol=ULPS[out.dtype])


def same_sum(summed: torch.Tensor, ref: torch.Tensor) -> None:
    """The residual stream is one rounded add: exact, except bf16's truncation when interpreted."""
    if INTERPRETED and summed.dtype == torch.bfloat16:
        close(summed, ref)
    else:
        assert torch.equal(summed, ref)


def data(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 2).to(dtype).to(DEVICE)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 9), st.sampled_from([64, 576, 1000]), st.sampled_from(DTYPES), st.integers(0, 1000))
def test_rms_norm_and_add_rms_norm(rows, cols, dtype, seed):
    x, r = data(rows, cols, dtype=dtype, seed=seed), data(rows, cols, dtype=dtype, seed=seed + 1)
    w = data(cols, dtype=dtype, seed=seed + 2)
    close(fused.rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5))
    out, summed = fused.add_rms_norm(x, r, w, 1e-6)
    ref_out, ref_summed = add_rms_norm_reference(x, r, w, 1e-6)
    same_sum(summed, ref_summed)
    close(out, ref_out)


def test_add_rms_norm_reads_strided_rows():
    wide = data(5, 1200, dtype=torch.float32, seed=3)
    x = wide[:, :576]  # a view whose rows are 1200 apart
    r, w = data(5, 576, dtype=torch.float32, seed=4), data(576, dtype=torch.float32, seed=5)
    out, summed = fused.add_rms_norm(x, r, w, 1e-5)
    ref_out, ref_summed = add_rms_norm_reference(x, r, w, 1e-5)
    close(out, ref_out)
    same_sum(summed, ref_summed)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 7), st.sampled_from([(4, 2, 16), (9, 3, 64), (8, 8, 128)]), st.sampled_from(DTYPES),
       st.integers(0, 1000))
def test_rope_of_q_and_k_views_of_one_projection(tokens, heads, dtype, seed):
    q_heads, k_heads, head_dim = heads
    qkv = data(tokens, (q_heads + 2 * k_heads) * head_dim, dtype=dtype, seed=seed)
    q, k, _ = qkv.split([q_heads * head_dim, k_heads * head_dim, k_heads * head_dim], dim=-1)
    q, k = q.view(tokens, q_heads, head_dim), k.view(tokens, k_heads, head_dim)  # strided, as in the model
    angles = torch.rand(tokens, head_dim // 2, generator=torch.Generator().manual_seed(seed)).to(DEVICE) * 100
    cos, sin = angles.cos(), angles.sin()
    q_out, k_out = fused.rope(q, k, cos, sin)
    q_ref, k_ref = rope_reference(q, k, cos, sin)
    close(q_out, q_ref)
    close(k_out, k_ref)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 9), st.sampled_from([32, 1536, 5000]), st.sampled_from(DTYPES), st.integers(0, 1000))
def test_silu_and_mul(rows, cols, dtype, seed):
    gate_up = data(rows, 2 * cols, dtype=dtype, seed=seed)
    close(fused.silu_and_mul(gate_up), silu_and_mul_reference(gate_up))


def test_each_backend_brings_its_fused_ops_and_the_switch_removes_them():
    from nanoserve.config import EngineArgs
    from nanoserve.kernels.cpu_fused import cpu_fused_ops
    from nanoserve.model.rank import attention_backend

    device = torch.device(DEVICE)
    assert attention_backend(EngineArgs(attention_backend="triton"), device).fused is fused.TRITON_FUSED
    assert attention_backend(EngineArgs(attention_backend="triton", fused_layer_ops=False), device).fused is None
    # The torch backend's are the C ones where they build (nanoserve/kernels/cpu_fused.py), else none.
    assert attention_backend(EngineArgs(attention_backend="torch"), device).fused is cpu_fused_ops()
    assert attention_backend(EngineArgs(attention_backend="torch", fused_layer_ops=False), device).fused is None
