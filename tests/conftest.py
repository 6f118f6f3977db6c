"""Shared fixtures: small random-weight HF checkpoints (built with transformers, the oracle)
and the embedded SmolLM2 directory."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("NANOSERVE_CHECK_INVARIANTS", "1")  # every engine step checks its allocator
# Parity with HF is exact in fp32: on CPUs with bf16 units the default would be bf16
# (device.resolve_dtype), so the suite pins fp32; tests that want bf16 name it.
os.environ.setdefault("NANOSERVE_CPU_DTYPE", "float32")
if not torch.cuda.is_available():
    # Triton kernels run on the CPU through Triton's interpreter. It is read when a kernel is
    # decorated, so it must be set before any kernel module is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY_VOCAB = 512


def backend_device(backend: str) -> str:
    """Where a test runs an attention backend: Triton on the GPU when there is one (the
    interpreter is off then, so Triton cannot run on the CPU), else on the CPU under the
    interpreter; torch always on the CPU (exact fp32 parity with HF)."""
    return "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"


def _tiny_config(arch: str, vocab_size: int = TINY_VOCAB, num_layers: int = 2):
    import transformers

    common = dict(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=num_layers, num_attention_heads=4,
                  max_position_embeddings=512, initializer_range=0.1)
    if arch == "llama":
        # Llama-3 style RoPE scaling, untied head, GQA.
        return transformers.LlamaForCausalLM, transformers.LlamaConfig(
            **common, intermediate_size=128, num_key_value_heads=2, tie_word_embeddings=False,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    if arch == "qwen2":
        return transformers.Qwen2ForCausalLM, transformers.Qwen2Config(
            **common, intermediate_size=128, num_key_value_heads=2, tie_word_embeddings=True)
    if arch == "qwen3":
        return transformers.Qwen3ForCausalLM, transformers.Qwen3Config(
            **common, intermediate_size=128, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)
    if arch == "opt":
        # OPT-350m's quirks: post-norm and project_in/out around a smaller embedding.
        return transformers.OPTForCausalLM, transformers.OPTConfig(
            **common, ffn_dim=128, word_embed_proj_dim=32, do_layer_norm_before=False, init_std=0.1)
    if arch == "opt-prenorm":
        return transformers.OPTForCausalLM, transformers.OPTConfig(**common, ffn_dim=128, init_std=0.1)
    raise ValueError(arch)


TINY_ARCHS = ["llama", "qwen2", "qwen3", "opt", "opt-prenorm"]


def build_tiny_model(arch: str, directory: Path, vocab_size: int = TINY_VOCAB, num_layers: int = 2, **save_kwargs):
    """A random-weight HF model saved to `directory`; norms and biases perturbed so that a
    wrongly loaded norm or bias cannot hide behind an initial value of 1 or 0. `vocab_size`:
    259 makes every id the model can draw one of `write_byte_tokenizer`'s tokens."""
    model_cls, config = _tiny_config(arch, vocab_size, num_layers)
    torch.manual_seed(1234)
    model = model_cls(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "bias" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.generation_config.eos_token_id = None  # greedy runs go the full length
    model.save_pretrained(directory, **save_kwargs)
    return model.eval()


@pytest.fixture(scope="session", params=TINY_ARCHS)
def tiny_model(request, tmp_path_factory):
    """(arch, HF model, checkpoint directory) for each supported architecture."""
    directory = tmp_path_factory.mktemp(f"tiny-{request.param}")
    return request.param, build_tiny_model(request.param, directory), directory


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """One random-weight tiny Llama checkpoint for the whole session (read only: a test that
    changes its files builds its own)."""
    directory = tmp_path_factory.mktemp("tiny-llama-shared")
    build_tiny_model("llama", directory)
    return directory


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from nanoserve import default_model

    return Path(default_model())


@pytest.fixture(scope="session")
def hf_gguf_model(smollm2_dir):
    """transformers reading the embedded GGUF itself (`gguf_file=`): the real-weight oracle."""
    from transformers import AutoModelForCausalLM

    from nanoserve.model.gguf import find_embedded_gguf

    path = find_embedded_gguf()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def write_byte_tokenizer(directory: Path) -> None:
    """A byte-level tokenizer for a tiny model: one token per byte (ids 0-255, GPT-2's alphabet,
    no merges), then `<|eos|>` (256), `<think>` (257) and `</think>` (258). Any text encodes, so
    structured outputs and the reasoning gate run on the tiny models (TINY_VOCAB >= 259). The
    model's config is told that its EOS is `<|eos|>`."""
    import json

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from nanoserve.tokenizer import bytes_to_unicode

    alphabet = bytes_to_unicode()
    backend = Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True) for t in ("<|eos|>", "<think>", "</think>")])
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eos|>"}))
    for name in ("config.json", "generation_config.json"):  # the model's EOS is the tokenizer's
        path = directory / name
        if path.is_file():
            config = json.loads(path.read_text())
            config.update(eos_token_id=256, bos_token_id=None, pad_token_id=None)
            path.write_text(json.dumps(config))
