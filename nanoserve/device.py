"""Where tensors live: the device and dtype an engine runs in, and the one host-to-device copy
helper every step input goes through."""
from __future__ import annotations

import os

import torch


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


def to_device(values: list, dtype: torch.dtype | None = None, *, device: torch.device) -> torch.Tensor:
    """A Python list as a tensor on `device`, without blocking the host. On CUDA through
    page-locked memory: a copy from pageable memory may wait for its stream to drain, which would
    stall the host behind the step in flight (asynchronous scheduling's next step, a copy
    stream's next layer). PyTorch's pinned allocator keeps the buffer until the copy has run."""
    pinned = device.type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=pinned).to(device, non_blocking=pinned)
