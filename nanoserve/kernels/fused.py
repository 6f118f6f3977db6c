# Triton kernel bodies (@triton.jit) take untyped pointer and tl.constexpr parameters; the launchers are typed.
# mypy: disable-error-code="no-untyped-def"
"""Fused elementwise kernels of a Llama-style decoder layer, in Triton (references: nanoserve/kernels/fused_ops.py).

An eager decoder layer launches about 45 kernels, most of them small elementwise ones: RMSNorm
alone is a cast, a square, a mean, an rsqrt, two multiplies and a cast back; rotate-half RoPE
splits, multiplies and concatenates q and k separately; SiLU·mul is two more. On a GPU each
launch costs the CPU some microseconds whatever the work, so a small model's step is bound by
launches (benchmarks/RESULTS.md: 21.9 ms eager against 0.97 ms of HBM traffic for a 1B-shaped
decode step at batch 64). Here each of those becomes one kernel:

    rms_norm(x, w)              y = w * (x / rms(x))                                  1 launch
    add_rms_norm(a, r, w)       h = r + a;  y = w * (h / rms(h));  returns (y, h)    1 launch
    rope(q, k, cos, sin)        rotate-half RoPE of q and k, into new tensors         1 launch
    rope_store(q, k, v, ...)    the same, k and v written to their KV cache slots     1 launch
                                (the layer's store_kv launch is gone)
    silu_and_mul(gate_up)       silu(gate) * up, gate and up the two halves           1 launch

Numerics follow the PyTorch code they replace (nanoserve/model/layers.py, llama.py), rounding
where it rounds: the residual sum is rounded to the model's dtype before it is normalised, the
normalised value is rounded before the weight multiplies it, silu(gate) is rounded before the
product. What can differ is the order of the fp32 sum in the mean and a fused multiply-add, a
last-bit difference in fp32 that rounding to bf16 hides almost always; the tests compare with
the references to fp32 rounding and the engine's greedy output near-tie for near-tie.

Rows are processed one per program, each with the whole hidden dimension in one block (up to
16K elements: every model here); the column index is padded to a power of two and masked.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.kernels.fused_ops import FusedOps
from nanoserve.kernels.store_kv import store_kv


# -- kernels ---------------------------------------------------------------------------------
@triton.jit
def _rms_norm_kernel(out, resid_out, x, residual, weight, stride_x, stride_r, stride_o, stride_ro, n_cols, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    h = tl.load(x + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual + row * stride_r + cols, mask=mask, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)  # rounded, as the model's add
        tl.store(resid_out + row * stride_ro + cols, h, mask=mask)
    hf = h.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(hf * hf, 0) / n_cols + eps)
    normed = (hf * inv).to(h.dtype).to(tl.float32)
    w = tl.load(weight + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + row * stride_o + cols, (w * normed).to(out.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(q_out, k_out, q, k, cos, sin, stride_q_tok, stride_q_head, stride_k_tok, stride_k_head,
                 stride_cos, num_q_heads, v, v_cache, slot_mapping, stride_v_tok, stride_v_head,
                 stride_c_block, stride_c_slot, stride_c_head,
                 HALF: tl.constexpr, HALF_PAD: tl.constexpr, STORE: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Program (token, head): heads 0..num_q_heads-1 of q, then k's. With STORE, `k_out` is the K
    cache: a k head goes to its token's slot (none for a negative slot), and v's head of the
    same index to the V cache (both caches with the `stride_c_*` strides)."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dims = tl.arange(0, HALF_PAD)
    mask = dims < HALF
    c = tl.load(cos + token * stride_cos + dims, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin + token * stride_cos + dims, mask=mask, other=0.0).to(tl.float32)
    if head < num_q_heads:
        src = q + token * stride_q_tok + head * stride_q_head
        dst = q_out + (token * (num_q_heads) + head) * (2 * HALF)
    else:
        kh = head - num_q_heads
        src = k + token * stride_k_tok + kh * stride_k_head
        if STORE:
            slot = tl.load(slot_mapping + token).to(tl.int64)
            mask = mask & ((dims * 0 + slot) >= 0)  # a padding token (negative slot) writes nothing
            slot = tl.maximum(slot, 0)
            at = (slot // BLOCK_SIZE) * stride_c_block + (slot % BLOCK_SIZE) * stride_c_slot + kh * stride_c_head
            dst = k_out + at
            v_src = v + token * stride_v_tok + kh * stride_v_head
            tl.store(v_cache + at + dims, tl.load(v_src + dims, mask=mask), mask=mask)
            tl.store(v_cache + at + HALF + dims, tl.load(v_src + HALF + dims, mask=mask), mask=mask)
        else:
            dst = k_out + (token * (tl.num_programs(1) - num_q_heads) + kh) * (2 * HALF)
    x1 = tl.load(src + dims, mask=mask, other=0.0)
    x2 = tl.load(src + HALF + dims, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(dst + dims, (a * c - b * s).to(x1.dtype), mask=mask)
    tl.store(dst + HALF + dims, (b * c + a * s).to(x1.dtype), mask=mask)


@triton.jit
def _silu_and_mul_kernel(out, gate_up, stride_in, stride_out, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * BLOCK
    cols = start + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(gate_up + row * stride_in + cols, mask=mask, other=0.0)
    u = tl.load(gate_up + row * stride_in + n_cols + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    silu = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)  # rounded, as F.silu's output
    tl.store(out + row * stride_out + cols, (silu * u.to(tl.float32)).to(out.dtype.element_ty), mask=mask)


# -- launchers -------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms_norm(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x): the layer's residual add and the next norm."""
    return _rms_norm(x, residual, weight, eps)


def _rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch of `_rms_norm_kernel`: (the normalised rows, the rows normalised), the second
    being `residual + x` when a residual is given, else `x` itself."""
    rows, cols = x.shape
    out = torch.empty_like(x)
    summed = x if residual is None else torch.empty_like(x)
    if rows:
        r = x if residual is None else residual  # never read without HAS_RESIDUAL
        _rms_norm_kernel[(rows,)](out, summed, x, r, weight, x.stride(0), r.stride(0), out.stride(0), summed.stride(0),
                                  cols, eps, HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(cols))
    return out, summed


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, heads, head_dim], k: [T, kv_heads, head_dim] (any row strides, contiguous head_dim);
    cos, sin: [T, head_dim // 2]. Returns new contiguous tensors."""
    tokens, q_heads, head_dim = q.shape
    k_heads = k.shape[1]
    q_out = torch.empty((tokens, q_heads, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((tokens, k_heads, head_dim), dtype=k.dtype, device=k.device)
    if tokens:
        cos, sin = cos.contiguous(), sin.contiguous()
        half = head_dim // 2
        _rope_kernel[(tokens, q_heads + k_heads)](q_out, k_out, q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0),
                                                  k.stride(1), cos.stride(0), q_heads, k, k, cos, 0, 0, 0, 0, 0,
                                                  HALF=half, HALF_PAD=triton.next_power_of_2(half), STORE=False,
                                                  BLOCK_SIZE=1)
    return q_out, k_out


def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """`rope`, with the rotated k and v written to the caches ([blocks, block_size, kv_heads,
    head_dim], one layout for both) at `slot_mapping` instead of returned; returns the rotated q."""
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:  # one kernel needs one layout
        q_out, k_out = rope(q, k, cos, sin)
        store_kv(k_out, v, k_cache, v_cache, slot_mapping)
        return q_out
    tokens, q_heads, head_dim = q.shape
    k_heads = k.shape[1]
    q_out = torch.empty((tokens, q_heads, head_dim), dtype=q.dtype, device=q.device)
    if tokens:
        if v.stride(2) != 1:
            v = v.contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        half = head_dim // 2
        _rope_kernel[(tokens, q_heads + k_heads)](q_out, k_cache, q, k, cos, sin, q.stride(0), q.stride(1),
                                                  k.stride(0), k.stride(1), cos.stride(0), q_heads, v, v_cache,
                                                  slot_mapping, v.stride(0), v.stride(1), k_cache.stride(0),
                                                  k_cache.stride(1), k_cache.stride(2), HALF=half,
                                                  HALF_PAD=triton.next_power_of_2(half), STORE=True,
                                                  BLOCK_SIZE=k_cache.shape[1])
    return q_out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    rows, width = gate_up.shape
    cols = width // 2
    out = torch.empty((rows, cols), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(4096, triton.next_power_of_2(cols))
        _silu_and_mul_kernel[(rows, triton.cdiv(cols, block))](out, gate_up, gate_up.stride(0), out.stride(0), cols,
                                                               BLOCK=block)
    return out


TRITON_FUSED = FusedOps(rms_norm, add_rms_norm, rope, silu_and_mul, rope_store)
