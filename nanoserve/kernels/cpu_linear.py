"""Linear layers on a CPU through oneDNN, each weight packed once (ours; issue 23).

`F.linear` on a CPU calls MKL's sgemm, which lays the weight out for its kernels (packs it) on
every call. At the few rows of a decode step that repacking is most of the product: measured
alone on a 2-core EPYC (AVX2, fp32), SmolLM2's gate/up projection at 9 rows took 0.91 ms with
`F.linear` and 0.36 ms with the weight packed once, its 49,152-row LM head 37 ms against 12 ms,
and a whole step's matmuls 91 ms against 38 ms (192 against 149 ms at 64 rows). vLLM's CPU
build packs its weights the same way. So, after the weights load, each linear layer of a CPU
model keeps a packed copy of its weight, and `linear` runs the product from it:

    module.weight           [out, in] fp32, as loaded: loading, the embedding lookup of a tied
                            LM head, tensor-parallel slices and tests still read it
    module.packed_weight    oneDNN's blocked layout of the same numbers (an opaque tensor)

The packed copy costs the weights' bytes again in host RAM (about 0.4 GiB for SmolLM2 in fp32).
The sums are the same products in another order: results differ from `F.linear` by fp32
rounding, as any two GEMM libraries do (greedy output is tested against HF's with the near-tie
rule).

oneDNN packs fp32 weights on any x86 CPU, and bf16 only where the CPU converts bf16 natively
(AVX512-BF16/AMX or AVX-NE-CONVERT); where `pack` cannot, the layer keeps `F.linear`.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


@functools.cache
def _torch_has_packed_linear() -> bool:
    """Whether this torch build has oneDNN and its packed linear op (not every build does)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._linear_pointwise  # noqa: B018  (looking it up is the test)
    except (AttributeError, RuntimeError):
        return False
    return True


def can_pack(weight: torch.Tensor) -> bool:
    """Whether `weight` can be packed here: a CPU tensor and a torch built with oneDNN."""
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and _torch_has_packed_linear())


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed copy of a [out, in] weight, or None where it cannot be packed."""
    if not can_pack(weight):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    except RuntimeError:  # e.g. bf16 on a CPU without native bf16 conversion
        return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias, from `packed` when there is one."""
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedWeight:
    """Mixin for a linear layer: `packed_weight` is None until `pack_weight` (F.linear then)."""

    packed_weight: torch.Tensor | None = None

    def pack_weight(self) -> bool:
        """Pack this layer's `weight` (call again after the weight changes). True if packed."""
        self.packed_weight = pack(self.weight)  # type: ignore[attr-defined]
        return self.packed_weight is not None


def pack_linear_weights(model: torch.nn.Module, logits_head: PackedWeight) -> int:
    """Pack every linear layer of a CPU `model` and the module that computes its logits (an
    embedding is packed only as that head: an untied model's input embedding never multiplies).
    Returns how many weights were packed."""
    layers = [m for m in model.modules() if isinstance(m, PackedWeight) and not isinstance(m, torch.nn.Embedding)]
    return sum(module.pack_weight() for module in [*layers, logits_head])
