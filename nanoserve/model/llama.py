"""Llama (Llama-2, Llama-3 with its RoPE scaling, SmolLM2) over a paged KV cache.

The layer structure and arithmetic mirror `transformers`' LlamaForCausalLM; two differences
are only in layout: q/k/v run as one fused matmul and gate/up as another (the HF tensors are
copied into the fused weights at load time), and attention reads K/V from the paged cache.

Qwen2 and Qwen3 differ from Llama in a flag or a hook and subclass these classes.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.config import ModelConfig
from nanoserve.model.attention import ForwardContext, PagedAttention
from nanoserve.model.causal_lm import CausalLM, DecoderBody
from nanoserve.model.layers import (
    LLAMA_STACKED,
    MergedLinear,
    RMSNorm,
    RotaryEmbedding,
    Weight,
    apply_rotary,
    load_named_weights,
)
from nanoserve.model.parallel import (
    SINGLE,
    ParallelLMHead,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    divide,
    even_shard,
    local_kv_heads,
    qkv_shards,
)
from nanoserve.model.stages import MissingLayer


class LlamaAttention(nn.Module):
    """Under tensor parallelism, this rank's query heads and the KV heads they read."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TPGroup = SINGLE):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.num_heads = divide(cfg.num_heads, tp.size, "the number of attention heads")
        self.num_kv_heads = local_kv_heads(cfg.num_kv_heads, tp.size)
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        full_q, full_kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, [full_q, full_kv, full_kv], cfg.attention_bias,
                                     qkv_shards(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, tp))
        self.o_proj = RowParallelLinear(full_q, cfg.hidden_size, cfg.o_proj_bias, tp)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, cfg.head_dim, cfg.head_dim**-0.5, layer_idx)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook for per-head q/k normalisation before RoPE (Qwen3). Llama has none."""
        return q, k

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.normalize_qk(q.view(n, self.num_heads, self.head_dim), k.view(n, self.num_kv_heads, self.head_dim))
        fused = ctx.backend.fused
        if fused is not None:
            # RoPE and the KV store in one kernel (nanoserve/kernels/fused.py's rope_store), then attention
            # over the cache. v stays a strided view of the fused projection's output.
            k_cache, v_cache = self.attn.cache(ctx)
            q = fused.rope_store(q, k, v.view(n, self.num_kv_heads, self.head_dim), cos, sin, k_cache, v_cache,
                                 ctx.slot_mapping)
            return self.o_proj(self.attn.attend(q, ctx))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.o_proj(self.attn(q.reshape(n, self.q_size), k.reshape(n, self.kv_size), v, ctx))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE):
        super().__init__()
        shard = even_shard(cfg.intermediate_size, tp, "the MLP width")
        self.intermediate_size = shard[1]
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, cfg.mlp_bias, [shard, shard])
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, tp)

    def forward(self, x: torch.Tensor, fused: Any = None) -> torch.Tensor:  # fused: AttentionBackend.fused
        if fused is not None:
            return self.down_proj(fused.silu_and_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    attention_cls: type[LlamaAttention] = LlamaAttention

    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TPGroup = SINGLE):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self.attention_cls(cfg, layer_idx, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg, tp)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The hidden state after this layer is `x + residual` (just `x` where `residual` is
        None), in and out: with the fused ops a layer hands on its MLP's output and the residual
        stream apart, so the next layer's first norm adds them in the same kernel (vLLM's
        layout) and no layer ends on an add of its own."""
        fused = ctx.backend.fused
        if fused is None:
            if residual is not None:
                x = x + residual
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
            return x + self.mlp(self.post_attention_layernorm(x)), None
        # The same layer in fewer launches (nanoserve/kernels/fused.py): each norm in one kernel with the
        # residual add before it.
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        if residual is None:
            normed, residual = fused.rms_norm(x, norm1.weight, norm1.eps), x
        else:
            normed, residual = fused.add_rms_norm(x, residual, norm1.weight, norm1.eps)
        attended = self.self_attn(normed, cos, sin, ctx)
        normed, residual = fused.add_rms_norm(attended, residual, norm2.weight, norm2.eps)
        return self.mlp(normed, fused), residual


class LlamaModel(DecoderBody):
    LAST_STAGE_ONLY = ("norm",)

    def __init__(self, cfg: ModelConfig, layer_cls: type[LlamaDecoderLayer], tp: TPGroup = SINGLE):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(layer_cls(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, ctx: ForwardContext,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """A pipeline stage (parallel/pipeline.py) passes the previous stage's `hidden` instead of
        ids, holds only its own layers, and only the last stage keeps the final norm."""
        if hidden is None:
            assert self.embed_tokens is not None  # the first stage embeds
            x = self.embed_tokens(input_ids)
        else:
            x = hidden
        cos, sin = self.rotary(positions)
        residual = None
        for i, layer in enumerate(self.layers):
            if isinstance(layer, MissingLayer):
                continue
            x, residual = layer(x, cos, sin, ctx, residual)
            if self.safe_point is not None:
                self.safe_point(i + 1)
        fused = ctx.backend.fused
        if residual is not None and self.norm is not None and fused is not None:
            # The last layer's MLP output, the residual stream and the final norm: one kernel, as
            # a layer's first norm adds them (rather than the add and the norm's ~8 ops).
            return fused.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)[0]
        if residual is not None:
            x = x + residual
        return x if self.norm is None else self.norm(x)


class LlamaForCausalLM(CausalLM):
    layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, self.layer_cls, tp)
        # Tied models reuse the embedding matrix as the LM head and own no separate weight.
        self.lm_head = None if cfg.tie_word_embeddings else ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)

    def body(self) -> LlamaModel:
        return self.model

    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> None:
        skip = ["rotary_emb.inv_freq"] + (["lm_head."] if self.lm_head is None else [])
        load_named_weights(self, weights, LLAMA_STACKED, skip)
