"""The decoder layer's elementwise ops on a CPU, each one C call (ours; issue 23).

PyTorch's RMSNorm is six ops (a cast, a square, a mean, an rsqrt, two multiplies and a cast
back), rotate-half RoPE about eight for q and k, SiLU·mul two or three; on a CPU each costs a
few microseconds of dispatch whatever its size, so at a decode step's few rows these ops cost
more than their arithmetic (benchmarks/RESULTS.md, issue 23). Here each is one call into
`cpu_fused.c`, with the signatures and reference semantics of nanoserve/kernels/fused.py's Triton
launchers, so the model runs either set the same way (AttentionBackend.fused):

    rms_norm(x, w, eps)              y = w * (x / rms(x))
    add_rms_norm(x, r, w, eps)       h = r + x;  (rms_norm(h), h)
    rope(q, k, cos, sin)             rotate-half RoPE of q and k, into new tensors
    rope_store(q, k, v, ..., slots)  the same, k and v written to their KV cache slots
    silu_and_mul(gate_up)            silu(gate) * up

The C code takes fp32 and bf16 CPU tensors (others run the PyTorch reference). The library is built
on first use (nanoserve/kernels/cpu_build.py); `cpu_fused_ops()` is None where it cannot be, and the torch
backend then runs PyTorch's ops. The results equal the references (nanoserve/kernels/fused_ops.py) to
fp32 rounding (tests/test_cpu_fused.py).
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path

import torch

from nanoserve.kernels import cpu_build
from nanoserve.kernels.fused_ops import (
    FusedOps,
    add_rms_norm_reference,
    rms_norm_reference,
    rope_reference,
    rope_store_reference,
    silu_and_mul_reference,
)

SOURCE = Path(__file__).with_suffix(".c")

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES: dict[str, Sequence[type]] = {
    "rms_norm": [_P] * 5 + [_I] * 6 + [_F],
    "rope": [_P] * 6 + [_I] * 9 + [_P] * 3 + [_I] * 6,
    "silu_mul": [_P] * 2 + [_I] * 4,
}
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


@cache
def _library() -> ctypes.CDLL | None:
    return cpu_build.load(SOURCE, {f"{name}_{suffix}": types for name, types in _SIGNATURES.items()
                                   for suffix in _SUFFIX.values()})


def _native(*tensors: torch.Tensor) -> bool:
    """Whether the C code takes these: CPU tensors of one dtype it has (fp32, bf16)."""
    first = tensors[0]
    return first.dtype in _SUFFIX and all(t.device.type == "cpu" and t.dtype == first.dtype for t in tensors)


def _fn(name: str, dtype: torch.dtype) -> Callable[..., int]:
    return getattr(_library(), f"{name}_{_SUFFIX[dtype]}")


def _rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the normalised rows, the rows normalised): `residual + x` when a residual is given."""
    if x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        x = x.contiguous()
        residual = None if residual is None else residual.contiguous()
    weight = weight.contiguous()
    rows, cols = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    summed = x if residual is None else torch.empty_like(out)
    r = x if residual is None else residual
    _fn("rms_norm", x.dtype)(out.data_ptr(), summed.data_ptr(), x.data_ptr(),
                             None if residual is None else r.data_ptr(), weight.data_ptr(), rows, cols,
                             x.stride(0), r.stride(0), out.stride(0), summed.stride(0), eps)
    return out, summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not _native(x, weight):
        return rms_norm_reference(x, weight, eps)
    return _rms_norm(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x): the layer's residual add and the next norm."""
    if not _native(x, residual, weight):
        return add_rms_norm_reference(x, residual, weight, eps)
    return _rms_norm(x, residual, weight, eps)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, heads, head_dim], k: [T, kv_heads, head_dim] (any token and head strides, contiguous
    head_dim); cos, sin: fp32 [T, head_dim // 2]. Returns new contiguous tensors."""
    if not _native(q, k) or cos.device.type != "cpu":
        return rope_reference(q, k, cos, sin)
    if q.stride(2) != 1:
        q = q.contiguous()
    if k.stride(2) != 1:
        k = k.contiguous()
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    tokens, q_heads, head_dim = q.shape
    k_heads = k.shape[1]
    q_out = torch.empty((tokens, q_heads, head_dim), dtype=q.dtype)
    k_out = torch.empty((tokens, k_heads, head_dim), dtype=k.dtype)
    _fn("rope", q.dtype)(q_out.data_ptr(), k_out.data_ptr(), q.data_ptr(), k.data_ptr(), cos.data_ptr(),
                         sin.data_ptr(), tokens, q_heads, k_heads, head_dim // 2, q.stride(0), q.stride(1),
                         k.stride(0), k.stride(1), cos.stride(0), None, None, None, 0, 0, 1, 0, 0, 0)
    return q_out, k_out


def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """`rope`, with the rotated k and v written to the caches at `slot_mapping` (negative: not
    written) instead of returned; returns the rotated q."""
    if (not _native(q, k, v, k_cache, v_cache) or cos.device.type != "cpu" or k_cache.stride() != v_cache.stride()
            or k_cache.stride(3) != 1):
        return rope_store_reference(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    q, k, v = (t if t.stride(2) == 1 else t.contiguous() for t in (q, k, v))
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    tokens, q_heads, head_dim = q.shape
    q_out = torch.empty((tokens, q_heads, head_dim), dtype=q.dtype)
    _fn("rope", q.dtype)(q_out.data_ptr(), k_cache.data_ptr(), q.data_ptr(), k.data_ptr(), cos.data_ptr(),
                         sin.data_ptr(), tokens, q_heads, k.shape[1], head_dim // 2, q.stride(0), q.stride(1),
                         k.stride(0), k.stride(1), cos.stride(0), slots.data_ptr(), v.data_ptr(),
                         v_cache.data_ptr(), v.stride(0), v.stride(1), k_cache.shape[1], k_cache.stride(0),
                         k_cache.stride(1), k_cache.stride(2))
    return q_out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if not _native(gate_up):
        return silu_and_mul_reference(gate_up)
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    rows, width = gate_up.shape
    out = torch.empty((rows, width // 2), dtype=gate_up.dtype)
    _fn("silu_mul", gate_up.dtype)(out.data_ptr(), gate_up.data_ptr(), rows, width // 2, gate_up.stride(0),
                                   out.stride(0))
    return out


def cpu_fused_ops() -> FusedOps | None:
    """The C layer ops, or None where the library cannot be built (or is turned off)."""
    return CPU_FUSED if _library() is not None else None


CPU_FUSED = FusedOps(rms_norm, add_rms_norm, rope, silu_and_mul, rope_store)
