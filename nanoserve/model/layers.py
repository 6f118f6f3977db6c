"""Building blocks shared by the model files: norms, rotary embeddings, fused linears and the
weight-loading loop that maps Hugging Face parameter names onto them.

Numerics follow `transformers` exactly (RMSNorm in fp32, RoPE angles in fp32) so that fp32
logits match the HF implementation to rounding error.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from nanoserve.kernels.cpu_linear import PackedWeight, linear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_type(scaling: dict[str, Any] | None) -> str:
    return str((scaling or {}).get("rope_type", (scaling or {}).get("type", "default")))


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies of rotate-half RoPE, with linear, Llama-3 or YaRN scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    kind = rope_type(scaling)
    if kind == "default":
        return inv_freq
    assert scaling is not None
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    if kind == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    raise NotImplementedError(f"rope scaling type {kind!r} is not supported")


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN (Peng et al. 2023, §3.2, "NTK-by-parts"), as transformers computes it: dimensions
    that turn fewer than `beta_slow` times over the original context are interpolated (divided
    by `factor`), those that turn more than `beta_fast` times are kept, a linear ramp between."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dimension(rotations: float) -> float:  # the dimension that turns `rotations` times
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(beta_fast), dimension(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    dims = torch.arange(head_dim // 2, dtype=torch.float32, device="cpu")  # not the meta device models build on
    ramp = ((dims - low) / ((high - low) or 0.001)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """YaRN's scale of cos and sin ("attention factor": 0.1 ln(factor) + 1 unless given; 1 for the
    other types), as transformers applies it."""
    if rope_type(scaling) != "yarn":
        return 1.0
    assert scaling is not None

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(scaling["factor"], scaling["mscale"]) / mscale(scaling["factor"], scaling["mscale_all_dim"])
    return mscale(scaling["factor"])


class RotaryEmbedding(nn.Module):
    """Computes cos/sin once per forward for all layers: [num_tokens, head_dim // 2] each.

    The frequencies are a plain fp32 attribute, not a buffer: models are built on the meta
    device and materialised empty, which would wipe a buffer computed at construction.
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None):
        super().__init__()
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling)
        self.attention_factor = rope_attention_factor(scaling)  # YaRN scales cos and sin

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        if self.attention_factor != 1.0:
            return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor
        return freqs.cos(), freqs.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim] in HF's rotate-half layout."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class LazyWeight(Protocol):
    """A checkpoint tensor not read yet (model/loader.py's `CheckpointSlice`): `narrow` reads
    only the rows asked for, `materialize` the whole tensor."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor: ...

    def materialize(self) -> torch.Tensor: ...


# A weight may arrive as a tensor or as a lazy checkpoint slice that reads only the rows asked for.
Weight = torch.Tensor | LazyWeight


class ShardedWeight:
    """A layer that takes its own slice of each checkpoint tensor it owns (the tensor-parallel
    layers of model/parallel.py): the loader hands it the whole tensor instead of copying."""

    def load_weight(self, param_name: str, weight: Weight) -> None:
        """Copy this rank's slice of the checkpoint tensor `weight` into parameter `param_name`."""
        raise NotImplementedError


class MergedLinear(PackedWeight, nn.Linear):
    """Several HF projections that read the same input (q/k/v, gate/up), run as one matmul.

    The output is the parts concatenated in order; `load_part` copies one HF tensor into its rows.
    Under tensor parallelism each part is column-split: `part_shards` gives, per part, the
    (start, length) of the HF rows this rank holds (default: all of them).
    """

    def __init__(self, in_features: int, part_sizes: Sequence[int], bias: bool,
                 part_shards: Sequence[tuple[int, int]] | None = None):
        shards = list(part_shards) if part_shards is not None else [(0, size) for size in part_sizes]
        local = [length for _, length in shards]
        super().__init__(in_features, sum(local), bias=bias)
        self.part_sizes = local
        self.part_offsets = [sum(local[:i]) for i in range(len(local))]
        self.part_shards = shards

    def load_part(self, part: int, param_name: str, tensor: Weight) -> None:
        start, size = self.part_offsets[part], self.part_sizes[part]
        getattr(self, param_name).data[start : start + size].copy_(tensor.narrow(0, *self.part_shards[part]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed_weight)  # packed on a CPU: nanoserve/kernels/cpu_linear.py


# (HF module name, fused module name, part index) used by Llama-family models.
LLAMA_STACKED = [
    ("q_proj", "qkv_proj", 0), ("k_proj", "qkv_proj", 1), ("v_proj", "qkv_proj", 2),
    ("gate_proj", "gate_up_proj", 0), ("up_proj", "gate_up_proj", 1),
]


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, Weight]],
    stacked: Sequence[tuple[str, str, int]] = (),
    skip: Sequence[str] = (),
) -> None:
    """Copy HF-named tensors into `model`, routing stacked names into their MergedLinear part.

    Raises if a model parameter is left unloaded or a tensor has no home, so a wrong mapping
    fails loudly at load time rather than as silently wrong logits.
    """
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    # Every part of a MergedLinear must arrive on its own, so parts are tracked as "name#i".
    pending: set[str] = set()
    for module_name, module in modules.items():
        for param_name, _ in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            parts = len(module.part_sizes) if isinstance(module, MergedLinear) else 0
            pending.update([f"{full}#{i}" for i in range(parts)] if parts else [full])
    for name, tensor in weights:
        if any(pattern in name for pattern in skip):
            continue
        for hf_part, fused, index in stacked:
            key = f".{hf_part}."
            if key in name:
                module_name, param_name = name.replace(key, f".{fused}.").rsplit(".", 1)
                module = modules.get(module_name)
                if not isinstance(module, MergedLinear):
                    raise KeyError(f"checkpoint tensor {name} has no fused target {module_name}")
                module.load_part(index, param_name, tensor)
                pending.discard(f"{module_name}.{param_name}#{index}")
                break
        else:
            if name not in params:
                raise KeyError(f"checkpoint tensor {name} does not match any model parameter")
            module_name, param_name = name.rsplit(".", 1) if "." in name else ("", name)
            module = modules[module_name]
            if isinstance(module, ShardedWeight):  # a tensor-parallel layer takes its own slice
                module.load_weight(param_name, tensor)
            else:
                if params[name].shape != tuple(tensor.shape):
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model "
                                     f"{tuple(params[name].shape)}")
                params[name].data.copy_(tensor if isinstance(tensor, torch.Tensor) else tensor.materialize())
            pending.discard(name)
    if pending:
        raise KeyError(f"parameters missing from the checkpoint: {sorted(pending)[:8]}")
