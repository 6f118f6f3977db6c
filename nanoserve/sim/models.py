"""The papers' models by name, as `ModelConfig`s taken from their published config.json files
(layers, hidden size, heads, KV heads, intermediate size, vocabulary). Those fix what the
simulator charges: weight bytes per layer and KV bytes per token.

    Llama-2-7B    32 layers, hidden 4096, 32 heads, 32 KV heads, MLP 11008 (SwiGLU), vocab 32000
    Qwen2.5-14B   48 layers, hidden 5120, 40 heads,  8 KV heads, MLP 13824 (SwiGLU), vocab 152064
    Qwen2.5-72B   80 layers, hidden 8192, 64 heads,  8 KV heads, MLP 29568 (SwiGLU), vocab 152064
    OPT-13B       40 layers, hidden 5120, 40 heads, 40 KV heads, FFN 20480 (ReLU),  vocab 50272
    OPT-30B       48 layers, hidden 7168, 56 heads, 56 KV heads, FFN 28672 (ReLU),  vocab 50272
    Llama-3-70B   80 layers, hidden 8192, 64 heads,  8 KV heads, MLP 28672 (SwiGLU), vocab 128256
    OPT-175B      96 layers, hidden 12288, 96 heads, 96 KV heads, FFN 49152 (ReLU), vocab 50272

Weights are bf16/fp16 (2 bytes), as the papers serve them.
"""
from __future__ import annotations

from dataclasses import dataclass

from nanoserve.config import ModelConfig

BYTES = 2  # bf16 / fp16


def _config(arch: str, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int, vocab: int,
            max_len: int, tied: bool = False, qkv_bias: bool = False) -> ModelConfig:
    return ModelConfig(architecture=arch, vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=hidden // heads,
                       max_position_embeddings=max_len, tie_word_embeddings=tied, attention_bias=qkv_bias)


MODELS: dict[str, ModelConfig] = {
    "Llama-2-7B": _config("llama", 32, 4096, 32, 32, 11008, 32000, 4096),
    "Qwen2.5-14B": _config("qwen2", 48, 5120, 40, 8, 13824, 152064, 32768, qkv_bias=True),
    "Qwen2.5-72B": _config("qwen2", 80, 8192, 64, 8, 29568, 152064, 32768, qkv_bias=True),
    "OPT-13B": _config("opt", 40, 5120, 40, 40, 20480, 50272, 2048, tied=True),
    "OPT-30B": _config("opt", 48, 7168, 56, 56, 28672, 50272, 2048, tied=True),
    "Llama-3-70B": _config("llama", 80, 8192, 64, 8, 28672, 128256, 8192),
    "OPT-175B": _config("opt", 96, 12288, 96, 96, 49152, 50272, 2048, tied=True),
}


def model(name: str) -> ModelConfig:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None


@dataclass(frozen=True)
class ModelCost:
    """What one decoder layer and the whole model weigh, in parameters and bytes."""

    config: ModelConfig

    @property
    def layer_params(self) -> int:
        """Matrix parameters of one decoder layer (biases and norms are noise at this scale)."""
        c = self.config
        q = c.num_heads * c.head_dim
        kv = c.num_kv_heads * c.head_dim
        attention = c.hidden_size * (q + 2 * kv) + q * c.hidden_size
        mlp_matrices = 2 if c.architecture == "opt" else 3  # OPT: fc1, fc2; SwiGLU: gate, up, down
        return attention + mlp_matrices * c.hidden_size * c.intermediate_size

    @property
    def embedding_params(self) -> int:
        return self.config.vocab_size * self.config.hidden_size

    @property
    def total_params(self) -> int:
        head = 0 if self.config.tie_word_embeddings else self.embedding_params
        return self.config.num_layers * self.layer_params + self.embedding_params + head

    @property
    def layer_bytes(self) -> int:
        return self.layer_params * BYTES

    @property
    def weight_bytes(self) -> int:
        return self.total_params * BYTES

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        return 2 * self.config.num_kv_heads * self.config.head_dim * BYTES

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_bytes_per_token_per_layer * self.config.num_layers
