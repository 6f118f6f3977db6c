"""Qwen2 / Qwen2.5: Llama's architecture with a bias on the q/k/v projections (not on o_proj).

The bias flag comes from the config (`attention_bias=True` is set by the loader for Qwen2), so
the Llama code serves unchanged; tied or untied embeddings follow `tie_word_embeddings`.
Sliding-window attention (`use_sliding_window`) is off in every released Qwen2 checkpoint and
is not implemented; the loader rejects a config that turns it on.
"""
from __future__ import annotations

from nanoserve.model.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass
