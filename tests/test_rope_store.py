"""RoPE with the KV store in the same pass (`FusedOps.rope_store`), in C (nanoserve/kernels/cpu_fused.py) and
in Triton (nanoserve/kernels/fused.py, interpreted on a CPU), against its reference: RoPE, then
nanoserve/kernels/reference.store_kv. q, k and v are strided views of one projection row, as the model has
them; slots are scattered over a paged cache, some negative (padding: nothing written), in
either BROS direction (folded into the slot). The returned q and the cached k equal the
reference's to rounding; v is copied exactly; every slot the step does not name is untouched.
"""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.kernels import cpu_fused
from nanoserve.kernels.fused_ops import rope_store_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCKS, BLOCK_SIZE = 6, 4


def implementations():
    if cpu_fused.cpu_fused_ops() is not None:
        yield pytest.param(cpu_fused.rope_store, "cpu", id="c")
    triton_runs = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
    if triton_runs:
        from nanoserve.kernels import fused

        yield pytest.param(fused.rope_store, DEVICE, id="triton")


def close(out: torch.Tensor, ref: torch.Tensor) -> None:
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(out.float(), ref.float(), atol=1e-3, rtol=2 * 2**-7)


@pytest.mark.parametrize("rope_store, device", list(implementations()))
@settings(max_examples=20, deadline=None)
@given(tokens=st.integers(0, 9), heads=st.sampled_from([(9, 3, 64), (4, 2, 16), (8, 8, 128)]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 1000))
def test_rope_store_equals_rope_then_store(rope_store, device, tokens, heads, dtype, seed):
    q_heads, k_heads, dim = heads
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(tokens, (q_heads + 2 * k_heads) * dim, generator=g) * 2).to(dtype).to(device)
    q, k, v = qkv.split([q_heads * dim, k_heads * dim, k_heads * dim], dim=-1)
    q, k, v = q.view(tokens, q_heads, dim), k.view(tokens, k_heads, dim), v.view(tokens, k_heads, dim)
    angles = (torch.rand(tokens, dim // 2, generator=g) * 100).to(device)
    slots = torch.randperm(BLOCKS * BLOCK_SIZE, generator=g)[:tokens]
    slots[torch.rand(tokens, generator=g) < 0.25] = -1  # padding rows write nothing
    slots = slots.to(device)
    caches = [torch.randn(BLOCKS, BLOCK_SIZE, k_heads, dim, generator=g).to(dtype).to(device) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    q_out = rope_store(q, k, v, angles.cos(), angles.sin(), *caches, slots)
    q_ref = rope_store_reference(q, k, v, angles.cos(), angles.sin(), *ref_caches, slots)
    close(q_out, q_ref)
    close(caches[0], ref_caches[0])
    assert torch.equal(caches[1], ref_caches[1])  # v is copied, not computed


@pytest.mark.parametrize("rope_store, device", list(implementations()))
def test_caches_of_two_layouts_take_the_two_step_path(rope_store, device):
    """A K and a V cache with different strides cannot share one kernel's addressing: RoPE and
    the store run apart, with the same result."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(3, h, 16, generator=g).to(device) for h in (4, 2, 2))
    angles = torch.rand(3, 8, generator=g).to(device)
    slots = torch.tensor([5, -1, 2], device=device)
    k_cache = torch.zeros(BLOCKS, BLOCK_SIZE, 2, 16, device=device)
    v_cache = torch.zeros(BLOCKS, BLOCK_SIZE, 4, 16, device=device)[:, :, :2]  # two heads of four: other strides
    ref = [torch.zeros(BLOCKS, BLOCK_SIZE, 2, 16, device=device) for _ in range(2)]
    q_out = rope_store(q, k, v, angles.cos(), angles.sin(), k_cache, v_cache, slots)
    q_ref = rope_store_reference(q, k, v, angles.cos(), angles.sin(), *ref, slots)
    close(q_out, q_ref)
    close(k_cache, ref[0])
    assert torch.equal(v_cache, ref[1])

