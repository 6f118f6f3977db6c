"""Frozen configuration objects.

Each config is immutable once the engine is built: a component that needs a value reads it
from its config rather than keeping a mutable copy, so two components can never disagree.

`ModelConfig` is the architecture, parsed from an HF `config.json` by `model/loader.py`.
`SchedulerConfig` holds the per-step limits a user sets through `LLM(...)`; the rest of the
user's arguments live in `builder.EngineArgs`.
"""
from __future__ import annotations

import os

from dataclasses import dataclass, field
from typing import Any

import torch

from nanoserve.slo import DEFAULT_SLOS, SLO, RequestClass


@dataclass(frozen=True)
class ModelConfig:
    """The parts of an HF config.json the model code needs, normalised across architectures."""

    architecture: str  # "llama" | "qwen2" | "qwen3" | "opt"
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # OPT: ffn_dim
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v (Qwen2: True)
    o_proj_bias: bool = False
    mlp_bias: bool = False
    # OPT-only
    do_layer_norm_before: bool = True
    word_embed_proj_dim: int | None = None
    remove_final_layer_norm: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V one token occupies across all layers."""
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits shared by every policy.

    `max_num_batched_tokens` is the token budget of one step: decode tokens and prefill chunks
    together. `max_model_len` bounds prompt + generated tokens of any single request.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 2048
    policy: str = "fcfs"
    # Latency targets by request class (see nanoserve/slo.py); a request may override them.
    online_slo: SLO = DEFAULT_SLOS[RequestClass.ONLINE]
    offline_slo: SLO = DEFAULT_SLOS[RequestClass.OFFLINE]
    # Micro-batches a pipelined step runs (nanoserve/dist/pipeline.py; 1: no pipeline). A policy
    # that cuts its own (KunServe) gives each step up to this many.
    pipeline_microbatches: int = 1
    # Micro-batches an asynchronous pipeline keeps in flight (1: every step waits for its
    # result). Above 1, each step is one micro-batch (`Engine`'s pipelined step) and the policy
    # gives it at most its share, 1/this, of the running requests (`Scheduler.running_share`).
    microbatches_in_flight: int = 1
    # vLLM v1's asynchronous scheduling (one device, no pipeline): the engine schedules and
    # prepares step n+1 while the device runs step n, and a running request's token still in
    # flight is fed to it on the device (`Scheduler.schedulable`). Two steps are in flight.
    async_scheduling: bool = False
    # Knobs of the chosen policy, by name; each policy declares the ones it takes
    # (`Scheduler.OPTIONS`) and refuses any other.
    policy_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.pipeline_microbatches < 1:
            raise ValueError("pipeline_microbatches must be >= 1")
        if self.microbatches_in_flight < 1:
            raise ValueError("microbatches_in_flight must be >= 1")
        if self.async_scheduling and self.microbatches_in_flight > 1:
            raise ValueError("async_scheduling is for one device; a pipeline keeps micro-batches in flight instead")

    @property
    def steps_in_flight(self) -> int:
        """Steps the engine keeps submitted and not yet collected: two under asynchronous
        scheduling (the device runs one while the host prepares the next), else one per
        micro-batch in flight."""
        return 2 if self.async_scheduling else self.microbatches_in_flight

    def slo_for(self, priority: RequestClass | str) -> SLO:
        # ==, not is: the engine asks before the Request it builds has coerced a raw string.
        return self.online_slo if priority == RequestClass.ONLINE else self.offline_slo


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


_DTYPE_NAMES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


CPU_DTYPE_ENV = "NANOSERVE_CPU_DTYPE"  # overrides the CPU default (the test suite pins float32)


def cpu_has_fast_bf16() -> bool:
    """AMX tiles or AVX512-BF16: the CPUs whose bf16 matmuls beat fp32 (oneDNN uses them; on the
    2-core Xeon of issue 23, 314 against 162 tok/s). `get_cpu_capability()` says only
    "AVX512", which CPUs without bf16 units also report, so ask for the units themselves."""
    try:
        return bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())
    except AttributeError:  # a torch without the probes: assume the plain CPU
        return False


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """Unless the caller names one: bf16 on CUDA and on CPUs with bf16 units (`cpu_has_fast_bf16`),
    fp32 on other CPUs (exact parity with HF there). `$NANOSERVE_CPU_DTYPE` sets the CPU default."""
    if dtype is None or dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        if os.environ.get(CPU_DTYPE_ENV):
            return resolve_dtype(os.environ[CPU_DTYPE_ENV], device)
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPE_NAMES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPE_NAMES)}") from None
