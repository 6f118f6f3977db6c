"""The GPUs the papers ran on, as the simulator's roofline sees them (sim/roofline.py).

Peak numbers are vendor datasheet figures (dense bf16 tensor-core FLOP/s, HBM bandwidth and
capacity, NVLink and PCIe bandwidth per direction):

- A100 SXM4 40 GB / 80 GB: NVIDIA A100 Tensor Core GPU datasheet: 312 TFLOP/s bf16 dense,
  1,555 GB/s (40 GB) and 2,039 GB/s (80 GB) HBM, NVLink 3 600 GB/s, PCIe 4.0 x16 32 GB/s per
  direction (ConServe §3.2 quotes the same 32 GB/s for host swaps).
- H100 SXM5 80 GB: NVIDIA H100 datasheet: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3, NVLink 4
  900 GB/s, PCIe 5.0 x16 64 GB/s per direction.
- H200 SXM 141 GB: NVIDIA H200 datasheet: the H100's compute with 4.8 TB/s HBM3e and 141 GB.
- The network between instances, which KunServe's KV exchange and parameter restore cross:
  200 Gbps RDMA, KunServe's cluster A (Table 2): 25 GB/s.

Achieved fractions of those peaks (`Efficiency`) keep a roofline honest. They are assumptions
of the orders commonly reported, not measurements of ours:

- `compute` 0.6: large bf16 GEMMs at LLM shapes reach roughly 60-80% of peak with cuBLAS, and
  whole prefill iterations (attention and small ops included) are usually quoted at about half
  of peak model-FLOPs utilisation; 0.6 sits between.
- `memory` 0.8: decode is bound by reading weights and KV, and streaming kernels sustain about
  80-90% of HBM peak; paged attention a little less.
- `link` 0.8 of the nominal interconnect bandwidth for bulk copies (protocol overheads).
- `layer_overhead_s` 20 µs per decoder layer: about ten kernels a layer at 2 µs each to launch
  without CUDA graphs.
- `eager_layer_overhead_s` (ours, unset by default): the per-layer cost of a step that has a
  prefill chunk, for an engine that graphs its decode-only steps (benchmarks/sim_fidelity.py
  measures both on a GPU).
- `iteration_overhead_s` 2 ms per step: scheduling, input preparation and sampling in a Python
  engine (nanoserve's own scheduling step costs 1.5-4.7 ms at 1,000 running requests on this
  project's 2-core CPU, benchmarks/RESULTS.md). The simulator charges this constant, not the
  scheduler's wall time here, so results do not depend on how busy this machine is.
- `host_overlap` (ours, off by default): the engine schedules asynchronously (nanoserve's
  `async_scheduling`, vLLM v1's), so that per-step host work runs while the device runs the
  step before: a step that follows another at once costs max(device, host), not their sum.

These factors are inputs, not results: every experiment prints the GPU it used, and changing a
factor changes the absolute times, never which code runs.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

GB = 1e9


@dataclass(frozen=True)
class Efficiency:
    compute: float = 0.6
    memory: float = 0.8
    link: float = 0.8
    layer_overhead_s: float = 20e-6
    iteration_overhead_s: float = 2e-3
    # Ours: a step the engine runs without a CUDA graph pays this per layer instead (nanoserve
    # graphs decode-only steps; a step with a prefill chunk launches its kernels one by one).
    # None: `layer_overhead_s` for every step, as the papers' eager engines ran.
    eager_layer_overhead_s: float | None = None
    # Ours: asynchronous scheduling. A step launched while the one before it still runs pays
    # max(its device time, iteration_overhead_s); one after the device idled pays both.
    # assumption: the host's work for a step is the same constant whether or not it overlaps,
    # and the policy schedules as the synchronous engine does (timing only: the real engine
    # schedules step n+1 before step n's tokens land, which changes a batch at most by a request
    # whose token in flight may be its last).
    host_overlap: bool = False


@dataclass(frozen=True)
class GPU:
    name: str
    flops: float  # peak dense bf16 FLOP/s
    hbm_bandwidth: float  # bytes/s
    memory_bytes: float
    nvlink_bandwidth: float  # bytes/s per direction, GPU to GPU within a server
    pcie_bandwidth: float  # bytes/s per direction, GPU to host
    network_bandwidth: float = 25 * GB  # bytes/s between servers (200 Gbps RDMA)
    efficiency: Efficiency = Efficiency()

    @property
    def compute_rate(self) -> float:
        """FLOP/s a layer achieves."""
        return self.flops * self.efficiency.compute

    @property
    def memory_rate(self) -> float:
        """HBM bytes/s a layer achieves."""
        return self.hbm_bandwidth * self.efficiency.memory

    def link_seconds(self, nbytes: float, link: str) -> float:
        """Time to move `nbytes` over "pcie", "nvlink" or "network" at the achieved rate."""
        bandwidth = {"pcie": self.pcie_bandwidth, "nvlink": self.nvlink_bandwidth,
                     "network": self.network_bandwidth}[link]
        return nbytes / (bandwidth * self.efficiency.link)

    def with_efficiency(self, **changes: Any) -> GPU:
        # Any: each field has its own type (float, float | None, bool); `replace` checks the names.
        return replace(self, efficiency=replace(self.efficiency, **changes))


GPUS: dict[str, GPU] = {
    "A100-40G": GPU("A100-40G", 312e12, 1555 * GB, 40 * GB, 600 * GB, 32 * GB),
    "A100-80G": GPU("A100-80G", 312e12, 2039 * GB, 80 * GB, 600 * GB, 32 * GB),
    "H100-80G": GPU("H100-80G", 989e12, 3350 * GB, 80 * GB, 900 * GB, 64 * GB),
    "H200": GPU("H200", 989e12, 4800 * GB, 141 * GB, 900 * GB, 64 * GB),
}


def gpu(name: str) -> GPU:
    try:
        return GPUS[name]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}") from None
