"""Turn user-facing arguments into a running `Engine`: load the model, size the KV cache, pick
the policy and the attention backend. `LLM` and the server both build through here."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import torch

from kernels.cpu_linear import pack_linear_weights
from nanoserve.config import ModelConfig, SchedulerConfig, resolve_device, resolve_dtype
from nanoserve.dist.launch import RankPlan, Topology
from nanoserve.model.parallel import SINGLE, TPGroup, local_kv_heads
from nanoserve.model.stages import partition_layers, stage_layouts
from nanoserve.engine import Engine
from nanoserve.kv_sizing import (MemoryProbe, check_host_kv_fits, host_kv_tokens_default, kv_budget_bytes,
                                 memory_probe, profile_batch)
from nanoserve.memory import NEEDS_HOST_STORE, KVBuildContext, make_kv_manager
from nanoserve.memory.arena import ArenaConfig, MemoryArena
from nanoserve.memory.arena_kv import ArenaKV
from nanoserve.memory.host import HostKVStore
from nanoserve.memory.manager import KVManager
from nanoserve.model.attention import AttentionBackend, default_attention_backend, get_attention_backend
from nanoserve.model.cuda_graphs import StepGraphs, decode_buckets, mixed_buckets
from nanoserve.model.layer_peer import move_weights_to_host
from nanoserve.model.loader import load_config, load_model, resolve_model_path
from nanoserve.model.runner import Executor, ModelRunner
from nanoserve.sched import POLICY_MEMORY, make_scheduler, scheduler_class
from nanoserve.sched.cost_model import CostModel
from nanoserve.slo import DEFAULT_SLOS, SLO, RequestClass
from nanoserve.tokenizer import Tokenizer

CPU_KV_BYTES = 2 << 30  # default KV budget on a CPU
CPU_KV_MAX_TOKENS = 65536  # ...capped in tokens so tiny test models do not allocate gigabytes
GPU_ACTIVATION_RESERVE = 1 << 30  # multi-rank only (no profile there): headroom for activations


class GraphSizes(NamedTuple):
    """The CUDA graphs a runner records: decode batch sizes and mixed-step token counts."""

    decode: tuple[int, ...]
    mixed: tuple[int, ...]


@dataclass(frozen=True)
class EngineArgs:
    model: str | None = None  # directory or cached hub id; None means the embedded SmolLM2
    device: str | None = None
    dtype: str | torch.dtype | None = None
    policy: str = "fcfs"
    kv_cache_tokens: int | None = None
    kv_cache_bytes: int | None = None
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int | None = None
    seed: int = 0
    attention_backend: str | None = None  # None: "triton" on CUDA, else "torch"
    gpu_memory_utilization: float = 0.9
    kv_manager: str | None = None  # see nanoserve/memory/__init__.py; None: the policy's own
    cost_model: str | None = None  # JSON from `python -m nanoserve.sched.profile`; None: a default
    kv_manager_options: dict | None = None  # knobs of the chosen manager
    policy_options: dict | None = None  # knobs of the chosen policy (its Scheduler.OPTIONS)
    host_kv_tokens: int | None = None  # host KV store size; default: kv_sizing.host_kv_tokens_default
    host_kv_bytes: int | None = None  # ...or in bytes (the server's --host-kv-gb); tokens win
    preempt_every_layers: int = 8  # ConServe §4.3: how often a pure-offline forward may be stopped
    # Stream each step's KV copies layer by layer, so a forward waits per layer for what it reads
    # (memory/host.py; BROS §4.1's max(T_exec, T_swap)). Off: a forward waits for whole copies.
    layerwise_kv_copies: bool = False
    tensor_parallel_size: int = 1  # >1 spawns worker processes (nanoserve/dist/launch.py)
    pipeline_parallel_size: int = 1  # stages of consecutive layers, one process (group) each
    pipeline_microbatches: int | None = None  # per pipelined step; None: twice the stages
    # Keep micro-batches in flight across steps (engine.py's pipelined step; vLLM v1's batch
    # queue): each step is one micro-batch and `pipeline_microbatches` (default: the stages) are
    # in flight. Off: each step's micro-batches fill and drain the pipeline. fcfs and kunserve.
    async_pipeline: bool = False
    # vLLM v1's asynchronous scheduling on one device (engine.py): schedule and prepare step
    # n+1 while the device runs step n. fcfs; no host KV store (its copy stream would not be
    # ordered after a step still in flight). Off by default.
    async_scheduling: bool = False
    # Decode steps replay CUDA graphs (model/cuda_graphs.py) on one CUDA device unless this is
    # set (vLLM's enforce_eager). `decode_graph_sizes`: the batch sizes to record; None: 1, 2, 4,
    # 8, then every 8 up to max_num_seqs on CUDA, none elsewhere (given on a CPU, the same path
    # runs without recording: for tests).
    enforce_eager: bool = False
    decode_graph_sizes: tuple[int, ...] | None = None
    # Mixed batches (prompt chunks with decodes) through CUDA graphs too, one per token count
    # (cuda_graphs.py; ours, after vLLM v1's full graphs). Off by default until measured on a
    # GPU; `mixed_graph_sizes` None: cuda_graphs.mixed_buckets of the token budget on CUDA, none
    # elsewhere (given on a CPU, the path runs without recording: for tests).
    mixed_graphs: bool = False
    mixed_graph_sizes: tuple[int, ...] | None = None
    # The backend's fused layer ops (Triton: kernels/fused.py; torch on a CPU: kernels/cpu_fused.py);
    # False: PyTorch's ops (an A/B switch)
    fused_layer_ops: bool = True
    # On a CPU, one rank: each linear layer also keeps its weight packed for oneDNN
    # (kernels/cpu_linear.py; the weights' bytes again in RAM). False: F.linear (an A/B switch).
    cpu_packed_linears: bool = True
    calibrate_cost_model: bool = True  # scale the cost model by measured step times (cost_model.py)
    online_slo: SLO | None = None  # the online class's default targets; None: DEFAULT_SLOS
    offline_slo: SLO | None = None


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


def profiled_kv_blocks(model: torch.nn.Module, cfg: ModelConfig, args: EngineArgs, device: torch.device,
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


def host_kv_blocks(args: EngineArgs, cfg: ModelConfig, dtype: torch.dtype, device_blocks: int) -> int:
    """The host store's blocks: the user's tokens or bytes, else `host_kv_tokens_default`;
    refused up front when the host's RAM cannot hold them (the bytes are pinned)."""
    token_bytes = kv_block_bytes(args, cfg, dtype) // args.block_size
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
    return resolve_model_path(args.model)


def build_engine(args: EngineArgs) -> Engine:
    path = model_path(args)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    cfg = load_config(path)
    tokenizer = Tokenizer.from_dir(path) if (path / "tokenizer.json").exists() else None

    policy = scheduler_class(args.policy)  # an unknown policy fails before any memory is allocated
    if microbatches_in_flight(args) > 1 and not policy.ASYNC_PIPELINE:
        raise ValueError(f"policy {args.policy!r} cannot schedule for an asynchronous pipeline (fcfs and kunserve can)")
    kv_manager = args.kv_manager or POLICY_MEMORY[args.policy]
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
        host_blocks = host_kv_blocks(args, cfg, dtype, num_blocks) if kv_manager in NEEDS_HOST_STORE else None
        plan = RankPlan(args, str(path), num_blocks, host_blocks, topology)
        if kv_manager == "arena":
            # KunServe (§4.1): weights and KV in one arena, so it is built from the loaded model.
            # The weights go to the host first (the device keeps one copy, the arena's); that host
            # copy feeds the pipeline peer on a drop and the arena on a restore (§4.2, §4.4). The
            # arena's bytes are the loaded weights' plus the profiled KV, as sized above.
            host_weights = move_weights_to_host(model)
            arena = MemoryArena(model, ArenaConfig.from_model_config(cfg, args.block_size, dtype, num_blocks), device)
            kv: KVManager = ArenaKV(arena)
            executor = ModelRunner(model, cfg, num_blocks, args.block_size, device, dtype, attention_backend(args, device),
                                   args.seed, arena=arena, host_weights=host_weights,
                                   preempt_every_layers=args.preempt_every_layers,
                                   layerwise_preemption=policy.PREEMPTS_RUNNING_BATCH)
        else:
            runner = executor = rank_runner(plan, model, cfg, device, SINGLE)
    else:
        if kv_manager == "arena":
            raise ValueError("the arena KV manager (KunServe's drop) runs on one device per instance; "
                             "use tensor_parallel_size=1 and pipeline_parallel_size=1")
        num_blocks = kv_cache_blocks(args, cfg, device, dtype, checkpoint_bytes(path, dtype) // topology.world_size)
        host_blocks = host_kv_blocks(args, cfg, dtype, num_blocks) if kv_manager in NEEDS_HOST_STORE else None
        plan = RankPlan(args, str(path), num_blocks, host_blocks, topology)
        runner, executor = _start_parallel(plan, device)
    if kv_manager != "arena":
        kv = make_kv_manager(kv_manager, KVBuildContext(num_blocks, args.block_size, cfg, runner.host_store,
                                                        args.kv_manager_options or {}))
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
    cost_model = CostModel.load(args.cost_model) if args.cost_model else None
    return Engine(make_scheduler(sched_config, kv, cost_model), executor, tokenizer, eos,
                  model_name=str(args.model or path.name), calibrate_cost_model=args.calibrate_cost_model,
                  pipeline=executor if args.async_pipeline or args.async_scheduling else None)


def check_async_scheduling(args: EngineArgs, policy: type, kv_manager: str, topology: Topology) -> None:
    """Refuse asynchronous scheduling where a step in flight could be overtaken: across ranks
    or stages (a pipeline keeps its own steps in flight: `async_pipeline`), with a host KV store
    (its copies run on their own stream, not ordered after the step still writing a freed
    block), or under a policy that plans with known tokens only."""
    if not policy.ASYNC_SCHEDULING:
        raise ValueError(f"policy {args.policy!r} cannot schedule asynchronously (fcfs can)")
    if topology.world_size > 1 or args.async_pipeline:
        raise ValueError("async_scheduling runs on one device; under pipeline parallelism use async_pipeline")
    if kv_manager in NEEDS_HOST_STORE or kv_manager == "arena":
        raise ValueError(f"async_scheduling needs a KV manager without host copies or layer changes; "
                         f"{kv_manager!r} has them")


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
    budget = (int(total * args.gpu_memory_utilization / sharing) - checkpoint_bytes(path, resolve_dtype(args.dtype, device))
              - GPU_ACTIVATION_RESERVE)
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


def attention_backend(args: EngineArgs, device: torch.device):
    backend = get_attention_backend(args.attention_backend or default_attention_backend(device), device)
    return backend if args.fused_layer_ops else replace(backend, fused=None)


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


def rank_runner(plan: RankPlan, model: torch.nn.Module, cfg: ModelConfig, device: torch.device, tp: TPGroup,
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
    from nanoserve.dist.channel import StepChannel
    from nanoserve.dist.executor import DriverExecutor
    from nanoserve.dist.launch import WorkerPool, join_group, rank_device, send_plan, stop_driver, torchrun_rank

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
