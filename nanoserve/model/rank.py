"""One rank's share of an engine: the plan rank 0 decides (`RankPlan`) and the model runner it
builds from it (`rank_runner`): the rank's model shard, its KV cache and host store, the CUDA
graphs it records, its attention kernels. The builder runs this for rank 0 (and for the only
rank of a single-device engine); each worker process runs it for its own rank
(parallel/worker.py).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import torch

from nanoserve.config import EngineArgs, ModelConfig, Topology
from nanoserve.device import resolve_dtype
from nanoserve.kernels.cpu_linear import pack_linear_weights
from nanoserve.memory.host import HostKVStore
from nanoserve.model.attention import AttentionBackend, default_attention_backend, get_attention_backend
from nanoserve.model.causal_lm import CausalLM
from nanoserve.model.cuda_graphs import decode_buckets, mixed_buckets
from nanoserve.model.loader import load_config, load_model
from nanoserve.model.parallel import TPGroup, local_kv_heads
from nanoserve.model.runner import ModelRunner
from nanoserve.model.stages import stage_layouts
from nanoserve.sched import scheduler_class


@dataclass(frozen=True)
class RankPlan:
    """What every rank needs to build its share of the engine, decided by rank 0."""

    args: EngineArgs
    model_path: str
    num_blocks: int
    host_blocks: int | None  # the host KV store's size; None: the KV manager keeps nothing there
    topology: Topology = Topology()


class GraphSizes(NamedTuple):
    """The CUDA graphs a runner records: decode batch sizes and mixed-step token counts."""

    decode: tuple[int, ...]
    mixed: tuple[int, ...]


def attention_backend(args: EngineArgs, device: torch.device) -> AttentionBackend:
    backend = get_attention_backend(args.attention_backend or default_attention_backend(device), device)
    return backend if args.fused_layer_ops else replace(backend, fused=None)


def graph_sizes(args: EngineArgs, device: torch.device, world_size: int) -> GraphSizes:
    """The CUDA graphs a single-rank runner records (cuda_graphs.py): decode batch sizes, and
    mixed-step token counts. On CUDA by default the decode buckets, and the mixed ones with
    `mixed_graphs`; named sizes are recorded on any device (on a CPU without recording: tests).
    None on CUDA with an attention backend a graph cannot record (torch's: it reads the batch's
    shape on the host); sizes named for one there are refused."""
    if args.enforce_eager or world_size > 1:
        return GraphSizes((), ())
    if device.type == "cuda" and not attention_backend(args, device).graph_capturable:
        if args.decode_graph_sizes or args.mixed_graph_sizes:
            raise ValueError(f"CUDA graphs cannot record the {args.attention_backend!r} attention backend (it reads "
                             "the batch's shape on the host): use the triton backend, or enforce_eager")
        return GraphSizes((), ())
    default = tuple(decode_buckets(args.max_num_seqs)) if device.type == "cuda" else ()
    decode = default if args.decode_graph_sizes is None else tuple(args.decode_graph_sizes)
    if args.mixed_graph_sizes is not None:
        mixed = tuple(args.mixed_graph_sizes)
    elif args.mixed_graphs and device.type == "cuda":
        mixed = tuple(mixed_buckets(args.max_num_seqs, args.max_num_batched_tokens))
    else:
        mixed = ()
    return GraphSizes(decode, mixed)


def rank_runner(plan: RankPlan, model: CausalLM, cfg: ModelConfig, device: torch.device, tp: TPGroup,
                stage_layers: range | None = None) -> ModelRunner:
    """The runner over a loaded shard: its KV cache and host store as `plan` sizes them."""
    args = plan.args
    dtype = resolve_dtype(args.dtype, device)
    host_store = None
    if plan.host_blocks is not None:
        host_store = HostKVStore(plan.host_blocks, args.block_size, cfg.num_layers,
                                 local_kv_heads(cfg.num_kv_heads, tp.size), cfg.head_dim, dtype,
                                 layerwise=args.layerwise_kv_copies, layers=stage_layers)
    decode_sizes, mixed_sizes = graph_sizes(args, device, plan.topology.world_size)
    if device.type == "cpu" and args.cpu_packed_linears and plan.topology.world_size == 1:
        pack_linear_weights(model, model.logits_head())
    longest = min(args.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings,
                  plan.num_blocks * args.block_size)
    return ModelRunner(model, cfg, plan.num_blocks, args.block_size, device, dtype, attention_backend(args, device),
                       args.seed, host_store, preempt_every_layers=args.preempt_every_layers, tp=tp,
                       stage_layers=stage_layers, cuda_graph_sizes=decode_sizes,
                       max_blocks_per_seq=-(-longest // args.block_size),
                       mixed_graph_sizes=mixed_sizes, max_num_seqs=args.max_num_seqs,
                       layerwise_preemption=scheduler_class(args.policy).PREEMPTS_RUNNING_BATCH)


def build_rank_runner(plan: RankPlan, device: torch.device, tp: TPGroup, stage: int = 0) -> ModelRunner:
    """One rank's model shard (its pipeline stage's layers, its tensor-parallel slices), KV cache
    share and host store (all of them with one rank)."""
    args = plan.args
    dtype = resolve_dtype(args.dtype, device)
    layout = None
    if plan.topology.pipeline_parallel_size > 1:
        layout = stage_layouts(load_config(Path(plan.model_path)).num_layers,
                               plan.topology.pipeline_parallel_size)[stage]
    model, cfg = load_model(Path(plan.model_path), device, dtype, tp, layout)
    return rank_runner(plan, model, cfg, device, tp, None if layout is None else layout.layers)
