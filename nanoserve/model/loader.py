"""Load a Hugging Face checkpoint: resolve the directory, parse config.json, stream the weights.

A model is named by a local directory or a hub id. Hub ids resolve through `huggingface_hub`
with `local_files_only=True`: nanoserve never downloads at run time, it only finds what a
previous `huggingface-cli download` left in the cache.

Weights come from `*.safetensors` (sharded with `model.safetensors.index.json`, or not) or,
failing that, `pytorch_model*.bin` through `torch.load(weights_only=True)`. The model is built
on the meta device and materialised empty on the target, so no memory is spent on a random
initialisation that the checkpoint would overwrite.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from nanoserve.config import ModelConfig
from nanoserve.model.causal_lm import CausalLM
from nanoserve.model.layers import SUPPORTED_ROPE_TYPES, rope_type
from nanoserve.model.llama import LlamaForCausalLM
from nanoserve.model.opt import OPTForCausalLM
from nanoserve.model.parallel import SINGLE, TPGroup
from nanoserve.model.qwen2 import Qwen2ForCausalLM
from nanoserve.model.qwen3 import Qwen3ForCausalLM
from nanoserve.model.stages import StageLayout, keep_stage

MODEL_CLASSES: dict[str, tuple[str, type[CausalLM]]] = {
    "LlamaForCausalLM": ("llama", LlamaForCausalLM),
    # Mistral's checkpoints have Llama's layout and names (a sliding window aside: parse_config).
    "MistralForCausalLM": ("llama", LlamaForCausalLM),
    "Qwen2ForCausalLM": ("qwen2", Qwen2ForCausalLM),
    "Qwen3ForCausalLM": ("qwen3", Qwen3ForCausalLM),
    "OPTForCausalLM": ("opt", OPTForCausalLM),
}


def resolve_model_path(model: str | Path, download: bool = False) -> Path:
    """A local directory as is, or a hub id: from the local HF cache, or with `download` (the
    `--download` flag, or NANOSERVE_ALLOW_DOWNLOAD=1) fetched through huggingface_hub (weights,
    config, tokenizer and generation config; not other formats' weights)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    download = download or os.environ.get("NANOSERVE_ALLOW_DOWNLOAD", "") not in ("", "0")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(model), local_files_only=True))
    except Exception as exc:  # the hub raises several types for "not cached" and bad ids
        cached_error = exc
    if not download:
        raise FileNotFoundError(
            f"model {str(model)!r} is neither a directory nor a hub id in the local Hugging Face cache "
            f"(nanoserve does not download weights unless asked: --download or NANOSERVE_ALLOW_DOWNLOAD=1): "
            f"{cached_error}") from None
    try:
        return Path(snapshot_download(str(model), allow_patterns=DOWNLOAD_PATTERNS))
    except Exception as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise FileNotFoundError(f"could not download {str(model)!r} from the Hugging Face hub: {first_line}") from None


# What a download fetches: the safetensors weights and what the engine and tokenizer read.
DOWNLOAD_PATTERNS = ["*.safetensors", "*.safetensors.index.json", "*.json", "*.jinja", "tokenizer.model"]


def _as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    # transformers v5 writes `rope_parameters`; v4 wrote `rope_theta` and `rope_scaling`.
    params = raw.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    scaling = raw.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    return theta, scaling


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    arch_name = (raw.get("architectures") or [""])[0]
    if arch_name not in MODEL_CLASSES:
        raise ValueError(f"unsupported architecture {arch_name!r}; nanoserve supports {sorted(MODEL_CLASSES)}")
    arch = MODEL_CLASSES[arch_name][0]
    common = dict(
        architecture=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=raw["num_attention_heads"],
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        eos_token_ids=_as_tuple(raw.get("eos_token_id")),
        bos_token_id=raw.get("bos_token_id"),
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        raw=raw,
    )
    if arch == "opt":
        bias = raw.get("enable_bias", True)
        return ModelConfig(
            **common,
            intermediate_size=raw["ffn_dim"],
            num_kv_heads=raw["num_attention_heads"],
            head_dim=raw["hidden_size"] // raw["num_attention_heads"],
            tie_word_embeddings=raw.get("tie_word_embeddings", True),
            attention_bias=bias, o_proj_bias=bias, mlp_bias=bias,
            do_layer_norm_before=raw.get("do_layer_norm_before", True),
            word_embed_proj_dim=raw.get("word_embed_proj_dim"),
            remove_final_layer_norm=raw.get("_remove_final_layer_norm", False),
        )
    if raw.get("use_sliding_window"):
        raise ValueError("sliding-window attention (use_sliding_window=true) is not supported")
    window = raw.get("sliding_window") if arch_name == "MistralForCausalLM" else None
    if window is not None and window < common["max_position_embeddings"]:
        # Ours: within the window, full attention is exactly the windowed one (Mistral 7B v0.1's
        # 4,096 tokens); past it it is not, so the context stops at the window.
        common["max_position_embeddings"] = int(window)
    theta, scaling = _rope(raw)
    if rope_type(scaling) not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"RoPE scaling type {rope_type(scaling)!r} is not supported (nanoserve has "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}): it depends on the sequence's length at each step")
    attention_bias = True if arch == "qwen2" else raw.get("attention_bias", False)
    return ModelConfig(
        **common,
        intermediate_size=raw["intermediate_size"],
        num_kv_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
        head_dim=raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        attention_bias=attention_bias,
        o_proj_bias=False if arch == "qwen2" else attention_bias,
        mlp_bias=raw.get("mlp_bias", False),
    )


def load_config(path: Path) -> ModelConfig:
    return parse_config(json.loads((path / "config.json").read_text()))


class CheckpointSlice:
    """A safetensors tensor not read yet: `narrow` reads only the rows a tensor-parallel rank
    keeps, `materialize` the whole tensor. Valid while its file is open (one loading pass)."""

    def __init__(self, handle: Any, name: str):
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self._slice[(slice(None),) * dim + (slice(start, start + length),)]

    def materialize(self) -> torch.Tensor:
        return self._slice[:]


def iter_weights(path: Path, lazy: bool = False) -> Iterator[tuple[str, torch.Tensor | CheckpointSlice]]:
    """Yield (HF name, tensor) from every weight file of a checkpoint, one tensor at a time.
    With `lazy`, safetensors tensors come as `CheckpointSlice`s, read when loaded."""
    from safetensors import safe_open

    safetensor_files = sorted(path.glob("*.safetensors"))
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        safetensor_files = [path / shard for shard in shards]
    if safetensor_files:
        for file in safetensor_files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, CheckpointSlice(f, name) if lazy else f.get_tensor(name)
        return
    bin_files = sorted(path.glob("pytorch_model*.bin"))
    if not bin_files:
        raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin weights in {path}")
    for file in bin_files:
        state = torch.load(file, map_location="cpu", weights_only=True)
        yield from state.items()
        del state


def load_model(path: Path, device: torch.device, dtype: torch.dtype, tp: TPGroup = SINGLE,
               stage: StageLayout | None = None) -> tuple[CausalLM, ModelConfig]:
    """The model; under tensor parallelism this rank's shard of it (reading only its slices);
    as a pipeline stage, only its layers (the others are never read)."""
    config = load_config(path)
    model_cls = MODEL_CLASSES[config.raw["architectures"][0]][1]
    with torch.device("meta"):
        model = model_cls(config, tp)
    skip = tuple(keep_stage(model, stage)) if stage is not None else ()

    def wanted(name: str) -> bool:  # checkpoints may drop the leading "model." (early OPT)
        return not (name if name.startswith(("model.", "lm_head.")) else f"model.{name}").startswith(skip)

    model = model.to(dtype=dtype).to_empty(device=device)
    with torch.no_grad():
        model.load_weights((n, t) for n, t in iter_weights(path, lazy=True) if not skip or wanted(n))
    return model.eval().requires_grad_(False), config
