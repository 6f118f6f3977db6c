"""Qwen3 (dense): Llama plus an RMSNorm over each head of q and of k, applied before RoPE.

Its head_dim is set explicitly in the config (128 for most sizes) and need not equal
hidden_size / num_heads.
"""
from __future__ import annotations

import torch

from nanoserve.config import ModelConfig
from nanoserve.model.layers import RMSNorm
from nanoserve.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from nanoserve.model.parallel import SINGLE, TPGroup


class Qwen3Attention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TPGroup = SINGLE):
        super().__init__(cfg, layer_idx, tp)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer
