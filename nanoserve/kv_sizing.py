"""How big the KV cache and the host KV store are, when the user names no size.

The device cache (vLLM's `determine_num_available_blocks`): load the weights first, then run one
profiling forward at the largest step the scheduler may build (`max_num_batched_tokens` tokens
over up to `max_num_seqs` sequences, each sampling), and give the KV cache what is left under
`gpu_memory_utilization` of the device:

    |<----------------------------- total device memory ------------------------------>|
    |<------------------ gpu_memory_utilization x total ------------------->|          |
    | other processes, | weights | activation peak | CUDA graphs | KV cache | headroom |
    | CUDA context     |<-- torch peak, profile -->|             |          |          |
      (non-torch)

    kv_bytes = utilization x total - torch peak - non-torch use - CUDA graphs

The CUDA graphs are recorded after the KV cache exists (they read its addresses), into a pool
of their own that the profiling forward's cached memory cannot serve: so the profile also
records every graph the engine will record, over its small cache, and measures what that took
(vLLM's CUDA-graph memory profiling; builder.graph_memory_bytes).

Sizing before the load (what this module replaces) budgeted the free memory of an empty device,
and the weights then landed on top: any model over a few GiB ran out of memory.

The host store: as many tokens as the device cache holds (a swap space the size of the cache,
vLLM's `swap_space` role), capped at a fraction of the host's RAM, because its bytes are pinned
and a pinned allocation the size of an 80 GB GPU's cache does not fit many hosts twice.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from nanoserve.request import Request
from nanoserve.sampling import MAX_LOGPROBS, SamplingParams
from nanoserve.sched.output import ScheduledChunk, SchedulerOutput

HOST_KV_RAM_FRACTION = 0.25  # ours: the default host store takes at most this share of host RAM


@dataclass(frozen=True)
class MemorySnapshot:
    """Device memory, in bytes, after a profiling forward."""

    total: int  # the device's memory
    free: int  # what the driver says is free now (all processes)
    torch_reserved: int  # what this process's caching allocator holds
    torch_peak: int  # the most this process's tensors held since the profile began


class MemoryProbe(Protocol):
    """Reads a device's memory; CUDA's is `CudaMemoryProbe`, tests pass a fake."""

    def reset_peak(self) -> None: ...

    def snapshot(self) -> MemorySnapshot: ...

    def release_cached(self) -> None:
        """Give the allocator's cached, unused memory back to the device (after the profile)."""


class CudaMemoryProbe:
    def __init__(self, device: torch.device):
        self.device = device

    def reset_peak(self) -> None:
        self.release_cached()  # the profile's peak starts from what is really held
        torch.cuda.reset_peak_memory_stats(self.device)

    def snapshot(self) -> MemorySnapshot:
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        return MemorySnapshot(total, free, torch.cuda.memory_reserved(self.device),
                              torch.cuda.max_memory_allocated(self.device))

    def release_cached(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()


def memory_probe(device: torch.device) -> MemoryProbe | None:
    """The probe that sizes the KV cache on `device`; None where a fixed budget applies (CPU)."""
    return CudaMemoryProbe(device) if device.type == "cuda" else None


def kv_budget_bytes(snapshot: MemorySnapshot, utilization: float) -> int:
    """What the KV cache may take: `utilization` of the device, less this process's peak during
    the profile (weights and activations) and what others hold (the CUDA context, other
    processes: the driver's used bytes that this process's allocator did not reserve)."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1]; got {utilization}")
    non_torch = max(0, snapshot.total - snapshot.free - snapshot.torch_reserved)
    return int(snapshot.total * utilization) - snapshot.torch_peak - non_torch


# Every row takes the sampler's widest path: penalties (counts over the vocabulary), min_p, a
# nucleus too wide for the candidates (bisection over the vocabulary) and the most logprobs.
WIDEST_SAMPLING = SamplingParams(temperature=1.0, top_p=0.9, min_p=0.01, repetition_penalty=1.1,
                                 frequency_penalty=0.1, max_tokens=1, logprobs=MAX_LOGPROBS)


def profile_batch(max_num_batched_tokens: int, max_num_seqs: int, block_size: int,
                  vocab_size: int) -> tuple[SchedulerOutput, int]:
    """The largest step the scheduler may build: `max_num_batched_tokens` prompt tokens spread
    over min(max_num_seqs, tokens) sequences, every one sampling (so the logits and sampler are
    at their widest too). Returns the batch and the KV blocks it writes to.

    Each draws at random through the penalties, min_p and top-p and reports the most logprobs
    (vLLM's dummy sampler run): the sampler's widest path, fp32 copies of the logits, the
    penalties' counts and the nucleus's bisection over the vocabulary, which a greedy profile
    would leave out of the budget."""
    num_seqs = max(1, min(max_num_seqs, max_num_batched_tokens))
    chunks, next_block = [], 0
    for i in range(num_seqs):
        length = max_num_batched_tokens // num_seqs + (i < max_num_batched_tokens % num_seqs)
        blocks = -(-length // block_size)
        token_ids = [(7 * i + j) % vocab_size for j in range(length)]
        request = Request(f"profile-{i}", token_ids, WIDEST_SAMPLING)
        chunks.append(ScheduledChunk(request, 0, length, list(range(next_block, next_block + blocks))))
        next_block += blocks
    return SchedulerOutput(chunks), next_block


def host_kv_tokens_default(device_tokens: int, token_bytes: int, host_ram_bytes: int | None = None) -> int:
    """The host store's default: the device cache's tokens, at most HOST_KV_RAM_FRACTION of the
    host's RAM (`host_ram_bytes`; read with psutil when None)."""
    if host_ram_bytes is None:
        import psutil

        host_ram_bytes = psutil.virtual_memory().total
    return min(device_tokens, int(host_ram_bytes * HOST_KV_RAM_FRACTION) // token_bytes)


def check_host_kv_fits(host_bytes: int, available_bytes: int | None = None) -> None:
    """Refuse, before pinning anything, a host store larger than the host's available RAM."""
    if available_bytes is None:
        import psutil

        available_bytes = psutil.virtual_memory().available
    if host_bytes > available_bytes:
        raise ValueError(f"the host KV store needs {host_bytes / 2**30:.1f} GiB but the host has "
                         f"{available_bytes / 2**30:.1f} GiB available; lower --host-kv-gb (or host_kv_tokens)")
