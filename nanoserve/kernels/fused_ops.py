"""The set of a decoder layer's ops a backend fuses, whatever runs them (nanoserve/kernels/fused.py:
Triton; nanoserve/kernels/cpu_fused.py: C on a CPU), and their PyTorch references: what every fused
kernel must equal, rounding where these round (nanoserve/model/layers.py's and llama.py's ops)."""
from __future__ import annotations

from typing import NamedTuple

import torch

from nanoserve.kernels.reference import store_kv


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    h = residual + x
    return rms_norm_reference(h, weight, eps), h


def rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        c, s = cos[:, None, :], sin[:, None, :]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def rope_store_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """RoPE of q and k, then the rotated k and v written to their cache slots (nanoserve/kernels/
    reference.store_kv: a negative slot is not written); returns the rotated q."""
    q_rot, k_rot = rope_reference(q, k, cos, sin)
    store_kv(k_rot, v, k_cache, v_cache, slot_mapping)
    return q_rot


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


class FusedOps(NamedTuple):
    """The layer ops a backend fuses (model/attention.py's AttentionBackend.fused): each with
    the signature and the semantics of its reference above."""

    rms_norm: object
    add_rms_norm: object
    rope: object
    silu_and_mul: object
    # RoPE with the KV store in the same pass (ours): the rotated k goes straight to its cache
    # slot, v beside it, so a layer has no store_kv kernel of its own.
    rope_store: object
