"""Finding and parsing checkpoints: hub ids from the local cache, config dialects, clear errors."""
from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_model

from nanoserve.model.loader import load_model, parse_config, resolve_model_path

LLAMA = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4}


def test_hub_id_resolves_from_the_local_cache_only(tmp_path, monkeypatch):
    # The layout huggingface_hub leaves behind after a download.
    repo = tmp_path / "hub" / "models--acme--tiny-llama"
    snapshot = repo / "snapshots" / "0123456789abcdef"
    build_tiny_model("llama", snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123456789abcdef")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_model_path("acme/tiny-llama") == snapshot
    model, cfg = load_model(resolve_model_path("acme/tiny-llama"), torch.device("cpu"), torch.float32)
    assert cfg.architecture == "llama"
    with pytest.raises(FileNotFoundError, match="does not download weights unless asked: --download"):
        resolve_model_path("acme/not-downloaded")
    # Asked to download with no network (the hub offline): one line that says so.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError, match="could not download 'acme/not-downloaded'") as caught:
        resolve_model_path("acme/not-downloaded", download=True)
    assert "\n" not in str(caught.value)


def test_rope_settings_in_both_transformers_dialects():
    v4 = parse_config({**LLAMA, "rope_theta": 500000.0,
                       "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})
    v5 = parse_config({**LLAMA, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 8192}})
    assert v4.rope_theta == v5.rope_theta == 500000.0
    assert v4.rope_scaling["factor"] == v5.rope_scaling["factor"] == 8.0
    plain = parse_config({**LLAMA, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert plain.rope_scaling is None and plain.num_kv_heads == 4 and plain.head_dim == 16


def test_qwen2_gets_qkv_bias_but_no_o_bias():
    cfg = parse_config({**LLAMA, "architectures": ["Qwen2ForCausalLM"]})
    assert cfg.attention_bias and not cfg.o_proj_bias


@pytest.mark.parametrize("raw, message", [
    ({**LLAMA, "architectures": ["MambaForCausalLM"]}, "unsupported architecture"),
    ({**LLAMA, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True}, "sliding-window"),
])
def test_unsupported_configs_are_refused(raw, message):
    with pytest.raises(ValueError, match=message):
        parse_config(raw)


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a directory nor a hub id"):
        resolve_model_path(tmp_path / "nope")
