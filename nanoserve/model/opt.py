"""OPT (Meta's 2022 decoder family) over a paged KV cache.

How it differs from Llama, following `transformers`' OPTForCausalLM:
- learned absolute position embeddings, looked up at `position + 2` (a fairseq legacy offset);
- LayerNorm with biases instead of RMSNorm, ReLU MLP (fc1/fc2) instead of gated SiLU;
- biases on every projection; no RoPE;
- `do_layer_norm_before=False` (OPT-350m) normalises after each residual add instead of before;
- `word_embed_proj_dim != hidden_size` (OPT-350m) adds project_in/project_out around the stack.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.config import ModelConfig
from nanoserve.model.attention import ForwardContext, PagedAttention
from nanoserve.model.causal_lm import CausalLM, DecoderBody
from nanoserve.model.layers import MergedLinear, Weight, load_named_weights
from nanoserve.model.parallel import (
    SINGLE,
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    divide,
    qkv_shards,
)
from nanoserve.model.stages import MissingLayer

POSITION_OFFSET = 2
OPT_STACKED = [("q_proj", "qkv_proj", 0), ("k_proj", "qkv_proj", 1), ("v_proj", "qkv_proj", 2)]
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"relu": F.relu, "gelu": F.gelu}


class OPTAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TPGroup = SINGLE):
        super().__init__()
        h = cfg.hidden_size
        heads = divide(cfg.num_heads, tp.size, "the number of attention heads")
        self.qkv_proj = MergedLinear(h, [h, h, h], cfg.attention_bias,
                                     qkv_shards(cfg.num_heads, cfg.num_heads, cfg.head_dim, tp))
        self.out_proj = RowParallelLinear(h, h, cfg.attention_bias, tp)
        self.attn = PagedAttention(heads, heads, cfg.head_dim, cfg.head_dim**-0.5, layer_idx)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        # Strided views of the QKV output: the KV store and the attention kernels read row strides.
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        return self.out_proj(self.attn(q, k, v, ctx))


class OPTDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TPGroup = SINGLE):
        super().__init__()
        self.pre_norm = cfg.do_layer_norm_before
        affine = cfg.raw.get("layer_norm_elementwise_affine", True)
        self.self_attn = OPTAttention(cfg, layer_idx, tp)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.hidden_size, elementwise_affine=affine)
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, tp)
        self.fc2 = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, tp)
        self.final_layer_norm = nn.LayerNorm(cfg.hidden_size, elementwise_affine=affine)
        self.act = ACTIVATIONS[cfg.raw.get("activation_function", "relu")]

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = self.self_attn_layer_norm(x) if self.pre_norm else x
        x = x + self.self_attn(h, ctx)
        if not self.pre_norm:
            x = self.self_attn_layer_norm(x)
        h = self.final_layer_norm(x) if self.pre_norm else x
        x = x + self.fc2(self.act(self.fc1(h)))
        return x if self.pre_norm else self.final_layer_norm(x)


class OPTDecoder(DecoderBody):
    FIRST_STAGE_ONLY = ("project_in", "embed_positions")
    LAST_STAGE_ONLY = ("final_layer_norm", "project_out")

    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE):
        super().__init__()
        embed_dim = cfg.word_embed_proj_dim or cfg.hidden_size
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, embed_dim, tp)
        self.embed_positions = nn.Embedding(cfg.max_position_embeddings + POSITION_OFFSET, cfg.hidden_size)
        projected = embed_dim != cfg.hidden_size
        self.project_in = nn.Linear(embed_dim, cfg.hidden_size, bias=False) if projected else None
        self.project_out = nn.Linear(cfg.hidden_size, embed_dim, bias=False) if projected else None
        has_final_norm = cfg.do_layer_norm_before and not cfg.remove_final_layer_norm
        affine = cfg.raw.get("layer_norm_elementwise_affine", True)
        self.final_layer_norm = nn.LayerNorm(cfg.hidden_size, elementwise_affine=affine) if has_final_norm else None
        self.layers = nn.ModuleList(OPTDecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, ctx: ForwardContext,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """As LlamaModel.forward: a later pipeline stage starts from `hidden`."""
        if hidden is None:
            assert self.embed_tokens is not None  # the first stage embeds
            x = self.embed_tokens(input_ids)
            if self.project_in is not None:
                x = self.project_in(x)
            x = x + self.embed_positions(positions + POSITION_OFFSET)
        else:
            x = hidden
        for i, layer in enumerate(self.layers):
            if isinstance(layer, MissingLayer):
                continue
            x = layer(x, ctx)
            if self.safe_point is not None:
                self.safe_point(i + 1)
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        return x


class OPTModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE):
        super().__init__()
        self.decoder = OPTDecoder(cfg, tp)


class OPTForCausalLM(CausalLM):
    BODY_PREFIX = "model.decoder"

    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE):
        super().__init__()
        self.config = cfg
        self.model = OPTModel(cfg, tp)
        embed_dim = cfg.word_embed_proj_dim or cfg.hidden_size
        self.lm_head = None if cfg.tie_word_embeddings else ParallelLMHead(cfg.vocab_size, embed_dim, tp)

    def body(self) -> OPTDecoder:
        return self.model.decoder

    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> None:
        # Early OPT checkpoints name tensors "decoder.*" rather than "model.decoder.*".
        renamed = ((f"model.{n}" if n.startswith("decoder.") else n, t) for n, t in weights)
        skip = ["lm_head."] if self.lm_head is None else []
        load_named_weights(self, renamed, OPT_STACKED, skip)
