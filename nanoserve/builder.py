"""Turn user-facing arguments into a running `Engine`: load the model, size the KV cache, pick
the policy and the attention backend. `LLM` and the server both build through here."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import cast

import torch

from nanoserve.config import EngineArgs, ModelConfig, SchedulerConfig, Topology
from nanoserve.device import resolve_device, resolve_dtype
from nanoserve.engine import Engine
from nanoserve.executor import Executor, MicrobatchPipeline
from nanoserve.generation_config import sampling_defaults
from nanoserve.kv_sizing import (
    MemoryProbe,
    check_host_kv_fits,
    host_kv_tokens_default,
    kv_budget_bytes,
    memory_probe,
    profile_batch,
)
from nanoserve.memory import NEEDS_HOST_STORE, KVBuildContext, make_kv_manager, resolve_prefix_caching
from nanoserve.memory.arena import ArenaConfig, MemoryArena
from nanoserve.memory.arena_kv import ArenaKV
from nanoserve.memory.manager import KVManager
from nanoserve.model.attention import AttentionBackend
from nanoserve.model.causal_lm import CausalLM
from nanoserve.model.cuda_graphs import StepGraphs
from nanoserve.model.layer_peer import move_weights_to_host
from nanoserve.model.loader import load_config, load_model, resolve_model_path
from nanoserve.model.parallel import SINGLE, local_kv_heads
from nanoserve.model.rank import GraphSizes, RankPlan, attention_backend, build_rank_runner, graph_sizes, rank_runner
from nanoserve.model.runner import ModelRunner
from nanoserve.model.stages import partition_layers
from nanoserve.sched import POLICY_MEMORY, make_scheduler, scheduler_class
from nanoserve.sched.base import Scheduler
from nanoserve.sched.cost_model import DEFAULT_COST_MODEL, CostModel
from nanoserve.slo import DEFAULT_SLOS, RequestClass
from nanoserve.tokenizer import Tokenizer

CPU_KV_BYTES = 2 << 30  # default KV budget on a CPU
CPU_KV_MAX_TOKENS = 65536  # ...capped in tokens so tiny test models do not allocate gigabytes
GPU_ACTIVATION_RESERVE = 1 << 30  # multi-rank only (no profile there): headroom for activations


def kv_block_bytes(args: EngineArgs, cfg: ModelConfig, dtype: torch.dtype) -> int:
    """One KV block's bytes on one rank (under tensor parallelism its KV heads of every layer it
    holds; a pipeline's stage 0 holds the most layers)."""
    heads = local_kv_heads(cfg.num_kv_heads, args.tensor_parallel_size)
    layers = len(partition_layers(cfg.num_layers, args.pipeline_parallel_size)[0])
    return cfg.kv_bytes_per_token(dtype) * heads * layers // (cfg.num_kv_heads * cfg.num_layers) * args.block_size


def kv_cache_blocks(args: EngineArgs, cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                    weight_bytes: int = 0) -> int:
    """How many KV blocks fit the user's token or byte budget, or a CPU's default budget. A
    single CUDA device is sized after its weights load, by a profiling forward instead
    (`profiled_kv_blocks`). Several CUDA ranks size here, before they load (ours: each rank's
    free memory less `weight_bytes`, its estimated share of the weights, and a fixed reserve
    for activations; a profile there would need every rank to agree on one count)."""
    block_bytes = kv_block_bytes(args, cfg, dtype)
    if args.kv_cache_tokens is not None:
        if args.kv_cache_tokens < args.block_size:
            raise ValueError(f"kv_cache_tokens must be at least block_size ({args.block_size})")
        return args.kv_cache_tokens // args.block_size
    if args.kv_cache_bytes is not None:
        budget = args.kv_cache_bytes
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = free - int(total * (1 - args.gpu_memory_utilization)) - GPU_ACTIVATION_RESERVE - weight_bytes
    else:
        budget = min(CPU_KV_BYTES, CPU_KV_MAX_TOKENS * block_bytes // args.block_size)
    return _blocks_in(budget, block_bytes)


def _blocks_in(budget: int, block_bytes: int) -> int:
    blocks = budget // block_bytes
    if blocks < 1:
        raise ValueError(f"the KV cache budget ({budget} bytes) holds no block of {block_bytes} bytes; "
                         "lower max_num_batched_tokens or raise gpu_memory_utilization")
    return blocks


def profiled_kv_blocks(model: CausalLM, cfg: ModelConfig, args: EngineArgs, device: torch.device,
                       dtype: torch.dtype, probe: MemoryProbe, graphs: GraphSizes = GraphSizes((), ())) -> int:
    """vLLM's sizing (kv_sizing.py): with the weights loaded, run the largest step the scheduler
    may build through a runner over a cache just big enough for it, record the CUDA graphs the
    engine will record (`graphs`) over that same small cache (`graph_memory_bytes`), then give
    the KV cache what `gpu_memory_utilization` of the device leaves beside the peak and them."""
    batch, blocks = profile_batch(args.max_num_batched_tokens, args.max_num_seqs, args.block_size, cfg.vocab_size)
    probe.reset_peak()
    backend = attention_backend(args, device)
    runner = ModelRunner(model, cfg, blocks, args.block_size, device, dtype, backend, args.seed)
    runner.execute(batch)
    snapshot = probe.snapshot()
    graph_bytes = graph_memory_bytes(runner, cfg, args, device, backend, probe, graphs)
    del runner
    probe.release_cached()
    # The profile's own cache is part of the peak, but the real cache replaces it: add it back.
    block_bytes = kv_block_bytes(args, cfg, dtype)
    budget = kv_budget_bytes(snapshot, args.gpu_memory_utilization) - graph_bytes + blocks * block_bytes
    return _blocks_in(budget, block_bytes)


def graph_memory_bytes(runner: ModelRunner, cfg: ModelConfig, args: EngineArgs, device: torch.device,
                       backend: AttentionBackend, probe: MemoryProbe, graphs: GraphSizes) -> int:
    """What the engine's CUDA graphs will hold: every graph it records (`graphs`), recorded
    here over the profile's small cache in one span, measured as the device memory that span
    took (vLLM's CUDA-graph memory profiling: the graphs are recorded after the KV cache exists,
    since they read its addresses, so their private pool cannot be seen by the profiling
    forward; it is a second copy of a step's activations beside the eager steps'). Every graph
    is recorded, not extrapolated from two: they share one pool, so the sum over sizes would
    overstate it. 0 when no graph is recorded (enforce_eager, a CPU)."""
    if not graphs.decode and not graphs.mixed:
        return 0
    longest = min(args.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    # Both readings without the allocator's cache: the profiling forward left its activations
    # cached, and recording empties the cache (torch.cuda.graph does, before each capture), so
    # a reading with them would net them against the pool and measure about nothing.
    probe.release_cached()
    before = probe.snapshot().free
    recorded = StepGraphs(runner.model, runner.kv_caches, backend, graphs.decode, -(-longest // args.block_size),
                          device, mixed_sizes=graphs.mixed, max_num_seqs=args.max_num_seqs)
    probe.release_cached()  # what the warm-up forwards left cached; the graphs' pool stays
    taken = max(0, before - probe.snapshot().free)
    del recorded
    return taken


def host_kv_blocks(args: EngineArgs, cfg: ModelConfig, dtype: torch.dtype, device_blocks: int,
                   kv_manager: str) -> int | None:
    """The host store's blocks: the user's tokens or bytes, else `host_kv_tokens_default`, for a
    manager that copies to the host; for the paged manager, its prefix cache's host tier
    (`prefix_cache_host_tokens`), or none. Refused up front when the host's RAM cannot hold
    them (the bytes are pinned)."""
    token_bytes = kv_block_bytes(args, cfg, dtype) // args.block_size
    if kv_manager not in NEEDS_HOST_STORE:
        if not args.prefix_cache_host_tokens:
            return None
        if kv_manager != "paged":
            raise ValueError(f"a host tier for the prefix cache runs over the paged KV manager, not {kv_manager!r}")
        blocks = args.prefix_cache_host_tokens // args.block_size
        check_host_kv_fits(blocks * args.block_size * token_bytes)
        return blocks
    if args.prefix_cache_host_tokens:
        raise ValueError(f"a host tier for the prefix cache runs over the paged KV manager, not {kv_manager!r}")
    if args.host_kv_tokens is not None:
        tokens = args.host_kv_tokens
    elif args.host_kv_bytes is not None:
        tokens = args.host_kv_bytes // token_bytes
    else:
        tokens = host_kv_tokens_default(device_blocks * args.block_size, token_bytes)
    blocks = tokens // args.block_size
    check_host_kv_fits(blocks * args.block_size * token_bytes)
    return blocks


def model_path(args: EngineArgs) -> Path:
    """The model's HF directory: `args.model`, or the embedded SmolLM2 converted on first use."""
    if args.model is None:
        from nanoserve.model.gguf import default_model

        return Path(default_model())
    return resolve_model_path(args.model, args.download)


def build_engine(args: EngineArgs) -> Engine:
    """The engine `args` describe, ready to serve."""
    return build_engine_and_runner(args)[0]


def build_engine_and_runner(args: EngineArgs) -> tuple[Engine, ModelRunner]:
    """The engine, and the model runner of its rank 0 (its executor on one device; under
    parallelism, the runner the driver executor wraps): what a KunServe cluster member drops
    layers on and the profiler times."""
    path = model_path(args)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    cfg = load_config(path)
    tokenizer = Tokenizer.from_dir(path, args.chat_template) if (path / "tokenizer.json").exists() else None

    policy = scheduler_class(args.policy)  # an unknown policy fails before any memory is allocated
    if microbatches_in_flight(args) > 1 and not policy.ASYNC_PIPELINE:
        raise ValueError(f"policy {args.policy!r} cannot schedule for an asynchronous pipeline (fcfs and kunserve can)")
    kv_manager = args.kv_manager or POLICY_MEMORY[args.policy]
    if kv_manager == "arena" and args.enable_prefix_caching:
        raise ValueError("the arena KV manager does not support prefix caching: a drop remaps its blocks and ships "
                         "their K/V to the pipeline peer (see nanoserve/memory/arena_kv.py); "
                         "use enable_prefix_caching=False")
    topology = Topology(args.tensor_parallel_size, args.pipeline_parallel_size)
    if args.async_scheduling:
        check_async_scheduling(args, policy, kv_manager, topology)
    if device.type == "cuda":
        if device.index is None:  # "cuda" means the current device; name it, as set_device needs
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)  # Triton launches, streams and events use the current device
    executor: Executor
    if topology.world_size == 1:
        # One device: the weights load first, then the KV cache takes what they and a profiling
        # forward leave (kv_sizing.py), unless the user named its size.
        model, cfg = load_model(path, device, dtype)
        probe = memory_probe(device) if args.kv_cache_tokens is None and args.kv_cache_bytes is None else None
        # The arena's runner records no graph (its layers change); any other records them.
        graphs = GraphSizes((), ()) if kv_manager == "arena" else graph_sizes(args, device, world_size=1)
        num_blocks = (kv_cache_blocks(args, cfg, device, dtype) if probe is None
                      else profiled_kv_blocks(model, cfg, args, device, dtype, probe, graphs))
        host_blocks = host_kv_blocks(args, cfg, dtype, num_blocks, kv_manager)
        plan = RankPlan(args, str(path), num_blocks, host_blocks, topology)
        if kv_manager == "arena":
            # KunServe (§4.1): weights and KV in one arena, so it is built from the loaded model.
            # The weights go to the host first (the device keeps one copy, the arena's); that host
            # copy feeds the pipeline peer on a drop and the arena on a restore (§4.2, §4.4). The
            # arena's bytes are the loaded weights' plus the profiled KV, as sized above.
            host_weights = move_weights_to_host(model)
            arena = MemoryArena(model, ArenaConfig.from_model_config(cfg, args.block_size, dtype, num_blocks), device)
            kv: KVManager = ArenaKV(arena)
            runner = executor = ModelRunner(model, cfg, num_blocks, args.block_size, device, dtype,
                                            attention_backend(args, device), args.seed, arena=arena,
                                            host_weights=host_weights, preempt_every_layers=args.preempt_every_layers,
                                            layerwise_preemption=policy.PREEMPTS_RUNNING_BATCH)
        else:
            runner = executor = rank_runner(plan, model, cfg, device, SINGLE)
    else:
        if kv_manager == "arena":
            raise ValueError("the arena KV manager (KunServe's drop) runs on one device per instance; "
                             "use tensor_parallel_size=1 and pipeline_parallel_size=1")
        num_blocks = kv_cache_blocks(args, cfg, device, dtype, checkpoint_bytes(path, dtype) // topology.world_size)
        host_blocks = host_kv_blocks(args, cfg, dtype, num_blocks, kv_manager)
        plan = RankPlan(args, str(path), num_blocks, host_blocks, topology)
        runner, executor = _start_parallel(plan, device)
    cost_model = CostModel.load(args.cost_model) if args.cost_model else None
    if kv_manager != "arena":
        kv = make_kv_manager(kv_manager, KVBuildContext(
            num_blocks, args.block_size, cfg, runner.host_store, args.kv_manager_options or {},
            prefix_caching=resolve_prefix_caching(kv_manager, args.enable_prefix_caching),
            prefix_host_blocks=host_blocks if kv_manager == "paged" and host_blocks else 0,
            recompute_seconds=(cost_model or DEFAULT_COST_MODEL).chunk_cost))
    microbatches = 1 if args.async_pipeline else pipeline_microbatches(args)
    max_model_len = min(args.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings,
                        kv.max_request_tokens)
    sched_config = SchedulerConfig(
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        max_model_len=max_model_len, policy=args.policy,
        online_slo=args.online_slo or DEFAULT_SLOS[RequestClass.ONLINE],
        offline_slo=args.offline_slo or DEFAULT_SLOS[RequestClass.OFFLINE],
        pipeline_microbatches=microbatches, microbatches_in_flight=microbatches_in_flight(args),
        async_scheduling=args.async_scheduling,
        policy_options=dict(args.policy_options or {}),
    )
    eos = frozenset(cfg.eos_token_ids) | (tokenizer.eos_token_ids if tokenizer is not None else frozenset())
    engine = Engine(make_scheduler(sched_config, kv, cost_model), executor, tokenizer, eos,
                    model_name=str(args.model or path.name), calibrate_cost_model=args.calibrate_cost_model,
                    sampling_defaults=sampling_defaults(path, args.generation_config, args.override_generation_config),
                    vocab_size=cfg.vocab_size, reasoning_parser=args.reasoning_parser,
                    structured_outputs_backend=args.structured_outputs_backend,
                    # Both executors built here, a ModelRunner and a DriverExecutor, are pipelines.
                    pipeline=(cast(MicrobatchPipeline, executor) if args.async_pipeline or args.async_scheduling
                              else None))
    return engine, runner


def check_async_scheduling(args: EngineArgs, policy: type[Scheduler], kv_manager: str, topology: Topology) -> None:
    """Refuse asynchronous scheduling where a step in flight could be overtaken: across ranks
    or stages (a pipeline keeps its own steps in flight: `async_pipeline`), with a host KV store
    (its copies run on their own stream, not ordered after the step still writing a freed
    block), or under a policy that plans with known tokens only."""
    if not policy.ASYNC_SCHEDULING:
        raise ValueError(f"policy {args.policy!r} cannot schedule asynchronously (fcfs can)")
    if topology.world_size > 1 or args.async_pipeline:
        raise ValueError("async_scheduling runs on one device; under pipeline parallelism use async_pipeline")
    if kv_manager in NEEDS_HOST_STORE or kv_manager == "arena" or args.prefix_cache_host_tokens:
        raise ValueError(f"async_scheduling needs a KV manager without host copies or layer changes; "
                         f"{kv_manager!r}{' with a host tier' if args.prefix_cache_host_tokens else ''} has them")


def shared_device_args(args: EngineArgs, sharing: int) -> EngineArgs:
    """`args` for one of `sharing` engines on one GPU (a cluster's instances in a test): each
    gets a 1/sharing part of `gpu_memory_utilization` of the device as a fixed KV byte budget,
    less its weights (estimated from the checkpoint) and an activation reserve. A profile
    would see the other engines' memory as used and their sizes would depend on start order."""
    device = resolve_device(args.device)
    if sharing <= 1 or device.type != "cuda" or args.kv_cache_tokens is not None or args.kv_cache_bytes is not None:
        return args
    path = model_path(args)
    total = torch.cuda.get_device_properties(device).total_memory
    budget = (int(total * args.gpu_memory_utilization / sharing)
              - checkpoint_bytes(path, resolve_dtype(args.dtype, device)) - GPU_ACTIVATION_RESERVE)
    if budget <= 0:
        raise ValueError(f"{sharing} engines cannot share {device}: a {1 / sharing:.0%} share of "
                         f"gpu_memory_utilization leaves no KV beside the weights")
    return replace(args, kv_cache_bytes=budget)


def microbatches_in_flight(args: EngineArgs) -> int:
    """Micro-batches an asynchronous pipeline keeps in flight: one per stage by default (vLLM's
    virtual engines, one per stage); 1 for synchronous steps."""
    if not args.async_pipeline:
        return 1
    if args.pipeline_parallel_size == 1:
        raise ValueError("async_pipeline needs pipeline_parallel_size > 1")
    return args.pipeline_microbatches or args.pipeline_parallel_size


def pipeline_microbatches(args: EngineArgs) -> int:
    """Micro-batches per step. Each pipelined step fills and drains the pipeline, idling
    (S - 1) / (m + S - 1) of it: more micro-batches shrink that, smaller ones run less
    efficiently; twice the stages is the default."""
    if args.pipeline_parallel_size == 1:
        return 1
    return args.pipeline_microbatches or 2 * args.pipeline_parallel_size


def checkpoint_bytes(path: Path, dtype: torch.dtype) -> int:
    """The weights' bytes in `dtype`, estimated from the checkpoint's safetensors headers (each
    tensor's element count; no tensor is read); used only where engines size their KV before
    they load."""
    import math

    from safetensors import safe_open

    elements = 0
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            elements += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    return elements * torch.empty((), dtype=dtype).element_size()


def _start_parallel(plan: RankPlan, device: torch.device) -> tuple[ModelRunner, Executor]:
    """Become rank 0 (starting ranks 1..N-1 unless torchrun did), send the workers the plan, and
    wrap this rank's runner in the executor that sends them each step."""
    from nanoserve.parallel.channel import StepChannel
    from nanoserve.parallel.executor import DriverExecutor
    from nanoserve.parallel.launch import WorkerPool, join_group, rank_device, send_plan, stop_driver, torchrun_rank

    topology = plan.topology
    launched = torchrun_rank()
    if launched is not None and launched != (0, topology.world_size):
        raise ValueError(f"under torchrun the engine is built by rank 0 of {topology.world_size} "
                         f"(tensor x pipeline parallel size); got (rank, world) {launched}")
    if launched is None and device.type == "cuda" and topology.world_size > torch.cuda.device_count():
        # NCCL runs one rank per GPU: ranks sharing one fail at their first collective ("Duplicate
        # GPU detected"), after every worker has started and loaded its weights. Refused first.
        raise ValueError(f"tensor x pipeline parallel size {topology.world_size} needs {topology.world_size} GPUs, "
                         f"one a rank; this machine has {torch.cuda.device_count()}")
    pool = None if launched else WorkerPool(topology, device)
    device = rank_device(device, 0)
    tp, control = join_group(0, topology, device, None if pool is None else pool.init_method)
    channel = StepChannel(control, topology.world_size, topology.pipeline_parallel_size > 1)
    try:
        send_plan(plan, control)
        runner = build_rank_runner(plan, device, tp)
    except BaseException:
        stop_driver(channel, pool)
        raise
    return runner, DriverExecutor(runner, channel, pool, topology, pipeline_microbatches(plan.args),
                                  depth=microbatches_in_flight(plan.args))
