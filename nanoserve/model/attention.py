"""Paged attention as the model sees it.

The model code is written for one flat batch of tokens from many sequences. Everything about
where those tokens' K/V live (block tables, slots, directions) arrives in a `ForwardContext`
built by the runner; the model never knows which policy or allocator produced it.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nanoserve.kernels import cpu_attention, cpu_decode_attention, cpu_fused, reference


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    store_kv: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    # The decoder layer's fused elementwise ops (RMSNorm, residual add + RMSNorm, RoPE, SiLU·mul:
    # nanoserve/kernels/fused.py in Triton, nanoserve/kernels/cpu_fused.py in C), or None for PyTorch's own ops.
    fused: Any = None
    # Can a CUDA graph record its kernels? Only if they read the batch's shape (sequence lengths,
    # query starts) on the device: torch's path reads them on the host (`.tolist()`), which a
    # capture refuses, so with it a CUDA engine runs eagerly (builder.graph_sizes).
    graph_capturable: bool = False


ATTENTION_BACKENDS = ("torch", "triton")


def default_attention_backend(device: torch.device) -> str:
    """Triton's compiled kernels on CUDA; PyTorch's ops elsewhere."""
    return "triton" if device.type == "cuda" else "torch"


def get_attention_backend(name: str, device: torch.device | None = None) -> AttentionBackend:
    """The kernels for `name`. Triton off CUDA runs only through its interpreter
    (TRITON_INTERPRET=1): correct and slow, which is how CI tests the kernels."""
    if name == "torch":
        # The reference's semantics with less memory traffic (nanoserve/kernels/cpu_attention.py), and the
        # layer's elementwise ops in C where that builds (nanoserve/kernels/cpu_fused.py; CPU tensors only,
        # others run PyTorch's references). Building here puts the one-off compile at start-up,
        # the decode attention's too (nanoserve/kernels/cpu_decode_attention.py).
        cpu_decode_attention.available()
        return AttentionBackend("torch", reference.store_kv, cpu_attention.paged_attention, cpu_fused.cpu_fused_ops())
    if name == "triton":
        if device is not None and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"the triton attention backend needs a CUDA device (got {device.type!r}); "
                             "set TRITON_INTERPRET=1 to run its kernels interpreted on the CPU")
        from nanoserve.kernels.fused import TRITON_FUSED
        from nanoserve.kernels.paged_attention import paged_attention
        from nanoserve.kernels.store_kv import store_kv

        return AttentionBackend("triton", store_kv, paged_attention, TRITON_FUSED, graph_capturable=True)
    raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(ATTENTION_BACKENDS)}")


@dataclass(frozen=True)
class ForwardContext:
    """Where this step's tokens read and write K/V. See nanoserve/kernels/reference.py for the layout."""

    slot_mapping: torch.Tensor  # int64 [num_tokens]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    seq_lens: torch.Tensor  # int32 [num_seqs]: context length after this step
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor] | None]  # per layer (k_cache, v_cache); None: not held here
    backend: AttentionBackend
    directions: torch.Tensor | None = None


class PagedAttention(nn.Module):
    """Stores this step's K/V into layer `layer_idx`'s cache, then attends over the cache."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, layer_idx: int):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.layer_idx = layer_idx

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """q: [T, num_heads * head_dim]; k, v: [T, num_kv_heads * head_dim]. Returns q's shape."""
        num_tokens = q.shape[0]
        k_cache, v_cache = self.cache(ctx)
        ctx.backend.store_kv(k.view(num_tokens, self.num_kv_heads, self.head_dim),
                             v.view(num_tokens, self.num_kv_heads, self.head_dim), k_cache, v_cache, ctx.slot_mapping)
        return self.attend(q.view(num_tokens, self.num_heads, self.head_dim), ctx)

    def cache(self, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's (K, V) cache, for a caller that stores the step's K/V itself (a fused
        RoPE + store kernel) and then calls `attend`."""
        cache = ctx.kv_caches[self.layer_idx]
        assert cache is not None, f"layer {self.layer_idx} runs where its KV cache is held"
        return cache

    def attend(self, q: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """q: [T, num_heads, head_dim], the step's K/V already in the cache. Returns [T, num_heads * head_dim]."""
        k_cache, v_cache = self.cache(ctx)
        out = ctx.backend.paged_attention(
            q, k_cache, v_cache, ctx.block_tables, ctx.seq_lens, ctx.query_start_loc,
            ctx.directions, self.scale,
        )
        return out.view(q.shape[0], self.num_heads * self.head_dim)
