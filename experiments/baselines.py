"""The baselines the papers measured against, as named simulator configurations.

A paper's ratio means something only against the system it was measured against. The papers ran
vLLM as it was then (2023-2024): no chunked prefill, swap preemption (EcoServe, BROS), or a
priority queue that could not preempt running offline work (ConServe); nanoserve's `fcfs` is vLLM
v1's scheduler, stronger than any of them. So each experiment runs the paper's own baseline from
this table, labels every row with it, and compares its ratio with the paper's number from the
same figure and the same baseline (`Comparison.baseline`).

Each entry: a label, the policy and KV manager that make it (sched/, memory/), any options, and
the sentence of the paper that defines it. Entries marked "ours" are stronger baselines we add,
so a reader sees how much of a paper's gain is its baseline's weakness.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from nanoserve.sim.simulation import SimConfig


@dataclass(frozen=True)
class Baseline:
    label: str
    policy: str
    kv_manager: str
    defined_by: str  # the paper's sentence (or "ours: ...") that defines it
    config: Mapping[str, Any] = field(default_factory=dict)  # other SimConfig fields
    kv_manager_options: Mapping[str, Any] = field(default_factory=dict)

    def sim_config(self, base: SimConfig) -> SimConfig:
        """`base` (the experiment's model, GPU, SLOs) with this baseline's policy and memory."""
        options = {**(base.kv_manager_options or {}), **self.kv_manager_options} or None
        return replace(base, policy=self.policy, kv_manager=self.kv_manager, kv_manager_options=options,
                       **dict(self.config))


VLLM_2023 = Baseline(
    "vLLM (2023): prefill-first + swap", "prefill-first", "swap",
    "EcoServe §2.1 compares with \"vLLM [13] with the KVC swapping strategy\"; BROS §7.1 with \"vLLM, the SOTA "
    "LLM serving system optimized for high-throughput text generation\" (2024, before chunked prefill): whole "
    "prompts in steps of their own, preemption by swapping blocks to host memory (vLLM §4.5)")
INFERCEPT = Baseline(
    "InferCept-like: fcfs + swap, copies layer by layer", "fcfs", "swap",
    "KunServe §5.1: \"InferCept designs an optimized swap mechanism that eliminates IO idle time atop vLLM\" and "
    "§2.3: \"under throttling, InferCept concurrently swaps out the KVCache of ongoing requests to hide the "
    "transfer overhead\". InferCept's code (WukLab/InferCept, SchedulerV2, policy V with chunk-fill, the one its "
    "scripts run): a running request short of KV swaps victims out, newest first, recomputes one only when the "
    "CPU swap space is full, and copies layer by layer on a side stream. Ours: no per-iteration swap budget "
    "(every copy overlaps the forward) and no discard of a swapped request while nothing waits",
    config={"layerwise_copies": True})
FASTGEN = Baseline(
    "FastGen-like: fcfs (chunked prefill + recompute)", "fcfs", "paged",
    "EcoServe §2.1: \"FastGen [14] with the recomputation strategy\": prompts split into chunks that share "
    "iterations with decodes (also vLLM v1's scheduler, KunServe's vLLM v0.6.3, whose \"vLLM uses "
    "recomputation to cope with memory throttling\", §5.1)")
VLLM_PP_CONSERVE = Baseline(
    "vLLM++ (ConServe): non-selective priority + swap", "priority-nonselective", "swap",
    "ConServe §6.1: \"we also enabled chunked-prefill in vLLM ... We additionally implemented a priority "
    "scheduler that prioritizes online requests over offline ones, and we refer to this enhanced baseline as "
    "vLLM++\"; §3: \"once offline requests are scheduled, they are batched together with online requests and "
    "cannot be pre-empted selectively\"")
VLLM_PP_CONSERVE_RECOMPUTE = Baseline(
    "vLLM++ (ConServe), recompute: non-selective priority + paged", "priority-nonselective", "paged",
    "assumption swept: vLLM 0.4.2, ConServe's base, recomputed a preempted single-sequence request by default, "
    "where ConServe §4.4 (Fig. 4b) describes vLLM as swapping")
VLLM_PP_SELECTIVE = Baseline(
    "vLLM++ (selective, recompute): priority + paged", "priority", "paged",
    "ours: an online arrival preempts running offline work at once, by recompute; stronger than ConServe's "
    "vLLM++")
ROUND_ROBIN = Baseline(
    "RR: round-robin + paged", "round-robin", "paged",
    "BROS §7.1: \"BROS-Round-Robin (referred to as RR), where we replace the scheduling algorithm of BROS with a "
    "Round-Robin schedule described in Sec. 2.2 and remove the bidirectional KV cache management\"")
ORCA = Baseline(
    "ORCA: max-allocation, batch 8", "fcfs", "exact",
    "EcoServe §2.1: \"The batch size of ORCA and FastServe was set to 8\", with max-allocation (every request "
    "reserves prompt + max_tokens: exact allocation with no predictor)",
    config={"max_num_seqs": 8},
    kv_manager_options={"padding_ratio": 0.0, "reserved_fraction": 0.0, "decoupled": False})
VLLM_2023_RECOMPUTE = Baseline(
    "vLLM v0, recompute: prefill-first + paged", "prefill-first", "paged",
    "ours, the row earlier runs called \"vLLM v0\": vLLM's 2023 scheduler with its default recompute preemption "
    "for single-sequence requests instead of the swap EcoServe configured")
ONLINE_ONLY = Baseline(
    "Online-Only: fcfs, online requests only", "fcfs", "paged",
    "ConServe §6.1: \"we evaluated it by only feeding online requests (referred to as Online-Only), which "
    "provides the optimal online serving latency but zero offline serving throughput\"")

BASELINES: dict[str, Baseline] = {b.label: b for b in (
    VLLM_2023, VLLM_2023_RECOMPUTE, INFERCEPT, FASTGEN, VLLM_PP_CONSERVE, VLLM_PP_CONSERVE_RECOMPUTE, VLLM_PP_SELECTIVE,
    ROUND_ROBIN, ORCA, ONLINE_ONLY)}


def markdown() -> str:
    """The table, for docs/reference/experiments.md and the experiments' reports."""
    rows = ["| baseline | policy | KV manager | defined by |", "|---|---|---|---|"]
    rows += [f"| {b.label} | `{b.policy}` | `{b.kv_manager}` | {b.defined_by} |" for b in BASELINES.values()]
    return "\n".join(rows) + "\n"


__all__ = ["BASELINES", "Baseline", "FASTGEN", "INFERCEPT", "ONLINE_ONLY", "ORCA", "ROUND_ROBIN", "VLLM_2023",
           "VLLM_2023_RECOMPUTE", "VLLM_PP_CONSERVE", "VLLM_PP_CONSERVE_RECOMPUTE", "VLLM_PP_SELECTIVE", "markdown"]
