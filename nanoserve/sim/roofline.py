"""An analytic iteration cost for a named model on a named GPU: the roofline the simulator's
virtual clock advances by (sim/executor.py).

Per decoder layer, for a batch of chunks (p cached tokens, c new ones), on one of `tp` tensor-
parallel GPUs:

    flops = 2 · T · P_layer / tp                               linear layers, T = Σ c
          + Σ 4 · d_q · c · (p + (c + 1) / 2) / tp             attention: QKᵀ and PV, causal
    bytes = W_layer / tp                                       weights, read once per iteration
          + Σ (p + c) · kv_layer / tp                          K/V read (context) and written
    time  = max(flops / achieved FLOP/s, bytes / achieved HBM bytes/s) + layer overhead
            (ours: an eager one for steps with a prefill chunk, when the GPU's efficiency sets one)
          + 2 all-reduces of T · hidden activations over NVLink (tp > 1)

and once per iteration the LM head for the sampled rows and the iteration overhead (ours: under
asynchronous scheduling, `host_overlap`, a step that follows another at once pays the larger of
its device time and that overhead, not their sum). Prefill
lands on the compute roof (T is large), decode on the memory roof (weights and context are read
for a single token each): the two regimes every paper's scheduler is built around. A pipeline
stage (`layers`) costs its share of layers; only the last runs the LM head.

Policies do not read this model: they budget with the linear `CostModel` of
sched/cost_model.py, which `fitted_cost_model` fits to this roofline over the same synthetic
batches `nanoserve profile` times on real hardware. A policy therefore meets
the simulated GPU as it meets a real one: through a profile, with its fitting error.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from nanoserve.config import ModelConfig
from nanoserve.sched.cost_model import Batch, CostModel, Sample, fit
from nanoserve.sim.hardware import GPU
from nanoserve.sim.models import BYTES, ModelCost

COLLECTIVE_LATENCY_S = 10e-6  # one NCCL all-reduce's fixed cost within a server


@dataclass(frozen=True)
class Roofline:
    gpu: GPU
    model: ModelConfig
    tp: int = 1
    layers: int | None = None  # a pipeline stage's decoder layers (default: all of them)
    last_stage: bool = True  # runs the LM head

    @cached_property
    def cost(self) -> ModelCost:
        return ModelCost(self.model)

    @property
    def num_layers(self) -> int:
        return self.model.num_layers if self.layers is None else self.layers

    def layer_seconds(self, batch: Batch) -> float:
        tokens = sum(c for _, c in batch)
        q_dim = self.model.num_heads * self.model.head_dim
        flops: float = 2 * tokens * self.cost.layer_params
        flops += sum(4 * q_dim * c * (p + (c + 1) / 2) for p, c in batch)
        nbytes = self.cost.layer_bytes + sum(p + c for p, c in batch) * self.cost.kv_bytes_per_token_per_layer
        gpu = self.gpu
        seconds = max(flops / self.tp / gpu.compute_rate, nbytes / self.tp / gpu.memory_rate)
        seconds += self.layer_overhead(batch)
        if self.tp > 1:
            activation = tokens * self.model.hidden_size * BYTES
            ring = 2 * (self.tp - 1) / self.tp * activation
            seconds += 2 * (gpu.link_seconds(ring, "nvlink") + COLLECTIVE_LATENCY_S)
        return seconds

    def layer_overhead(self, batch: Batch) -> float:
        """The fixed cost per layer: the eager one for a step with a prefill chunk, when the GPU's
        efficiency sets one (an engine that graphs decode-only steps), else the single constant."""
        efficiency = self.gpu.efficiency
        if efficiency.eager_layer_overhead_s is not None and any(c > 1 for _, c in batch):
            return efficiency.eager_layer_overhead_s
        return efficiency.layer_overhead_s

    def head_seconds(self, sampled_rows: int) -> float:
        if not self.last_stage or sampled_rows == 0:
            return 0.0
        flops = 2 * sampled_rows * self.model.hidden_size * self.model.vocab_size / self.tp
        nbytes = self.cost.embedding_params * BYTES / self.tp
        return max(flops / self.gpu.compute_rate, nbytes / self.gpu.memory_rate)

    def iteration_seconds(self, batch: Batch, sampled_rows: int | None = None, follows_step: bool = False) -> float:
        """One forward pass over `batch` ((prefix, new) chunks); `sampled_rows` defaults to one
        per chunk. An empty batch costs nothing: no forward runs. `follows_step`: the step is
        launched while the one before it runs; with the GPU's `host_overlap` (asynchronous
        scheduling) its host work then hides under the device's, and the step costs the larger
        of the two."""
        if not batch:
            return 0.0
        rows = len(batch) if sampled_rows is None else sampled_rows
        efficiency = self.gpu.efficiency
        if follows_step and efficiency.host_overlap:
            device = self.num_layers * self.layer_seconds(batch) + self.head_seconds(rows)
            return max(device, efficiency.iteration_overhead_s)
        return (self.num_layers * self.layer_seconds(batch) + self.head_seconds(rows)
                + efficiency.iteration_overhead_s)

    def chunk_seconds(self, prefix_len: int, num_new: int) -> float:
        """The layers' time for one chunk of `num_new` tokens after `prefix_len` (no head, no
        per-step overhead): what recomputing those tokens adds to a step (the prefix cache's
        host tier weighs it against loading their K/V)."""
        chunk = [(prefix_len, num_new)]
        return self.num_layers * (self.layer_seconds(chunk) - self.layer_overhead(chunk))

    def ideal_request_rate(self, mean_prompt: float, mean_output: float, kv_tokens: float,
                           max_in_flight: int | None = None) -> float:
        """Requests per second an ideal server sustains for these mean lengths (the experiments
        place their rates by it): C = KV tokens / (p + o/2) requests in flight (at most
        `max_in_flight`), each decode step of C requests at context p + o/2 costs t_step, a prompt
        costs its marginal prefill time t_p in such a step, so one request takes t_p + o * t_step
        / C of GPU time."""
        p, o = mean_prompt, mean_output
        held = p + o / 2
        in_flight = int(kv_tokens // held)
        in_flight = max(1, in_flight if max_in_flight is None else min(max_in_flight, in_flight))
        decodes = [(round(held), 1)] * in_flight
        t_step = self.iteration_seconds(decodes)
        t_prefill = self.iteration_seconds(decodes + [(0, round(p))]) - t_step
        return 1.0 / (t_prefill + o * t_step / in_flight)

    def kv_copy_seconds(self, num_tokens: int, link: str = "pcie") -> float:
        """Moving `num_tokens` tokens' K/V of this model's layers (on this GPU's share) over
        "pcie", "nvlink", "network", or within the device ("hbm": read and write)."""
        nbytes = num_tokens * self.cost.kv_bytes_per_token_per_layer * self.num_layers / self.tp
        if link == "hbm":
            return 2 * nbytes / self.gpu.memory_rate
        return self.gpu.link_seconds(nbytes, link)


def fitted_cost_model(roofline: Roofline, max_len: int = 8192, kv_tokens: int = 1 << 20) -> CostModel:
    """The linear cost model a policy would get by profiling this simulated GPU (profile.py's
    FULL grid, fitted the same way)."""
    from nanoserve.sched.profile_grid import FULL, synthetic_batches

    block = 16
    batches = synthetic_batches(FULL, max_len, kv_tokens // block, block)
    return fit(Sample(b, roofline.iteration_seconds(b)) for b in batches)
