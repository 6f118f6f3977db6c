"""Frozen configuration objects.

Each config is immutable once the engine is built: a component that needs a value reads it
from its config rather than keeping a mutable copy, so two components can never disagree.

`EngineArgs` is everything a user sets through `LLM(...)`, `nanoserve serve` or the server's
flags, and the one place each of their defaults is written: `SchedulerConfig`, the CLI and
`LLM` read theirs from it. `ModelConfig` is the architecture, parsed from an HF `config.json` by
`model/loader.py`. `SchedulerConfig` holds the per-step limits every policy shares.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nanoserve.slo import DEFAULT_SLOS, SLO, RequestClass

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class EngineArgs:
    model: str | None = None  # directory or hub id; None means the embedded SmolLM2
    download: bool = False  # fetch a hub id not in the local cache (also NANOSERVE_ALLOW_DOWNLOAD=1)
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
    cost_model: str | None = None  # JSON from `nanoserve profile`; None: a default
    kv_manager_options: dict | None = None  # knobs of the chosen manager
    # Automatic prefix caching (memory/prefix_cache.py; vLLM's flag): requests share the cached
    # K/V of a prompt prefix another request computed. None: on wherever the KV manager supports
    # it (paged, swap, checkpoint; memory.PREFIX_CACHING_MANAGERS), as vLLM v1 turns it on by default.
    enable_prefix_caching: bool | None = None
    # The prefix cache's second tier in host memory (ours; memory/prefix_host_tier.py): cached
    # blocks evicted from the device are kept in this many tokens of host RAM and loaded back on
    # a later hit. 0: off. The paged KV manager only.
    prefix_cache_host_tokens: int = 0
    policy_options: dict | None = None  # knobs of the chosen policy (its Scheduler.OPTIONS)
    host_kv_tokens: int | None = None  # host KV store size; default: kv_sizing.host_kv_tokens_default
    host_kv_bytes: int | None = None  # ...or in bytes (the server's --host-kv-gb); tokens win
    preempt_every_layers: int = 8  # ConServe §4.3: how often a pure-offline forward may be stopped
    # Stream each step's KV copies layer by layer, so a forward waits per layer for what it reads
    # (memory/host.py; BROS §4.1's max(T_exec, T_swap)). Off: a forward waits for whole copies.
    layerwise_kv_copies: bool = False
    tensor_parallel_size: int = 1  # >1 spawns worker processes (nanoserve/parallel/launch.py)
    pipeline_parallel_size: int = 1  # stages of consecutive layers, one process (group) each
    pipeline_microbatches: int | None = None  # per pipelined step; None: twice the stages
    # Keep micro-batches in flight across steps (engine.py's pipelined step; vLLM v1's batch
    # queue): each step is one micro-batch and `pipeline_microbatches` (default: the stages) are
    # in flight. Off: each step's micro-batches fill and drain the pipeline. fcfs and kunserve.
    # In KunServe's cluster (with the drop) the same for a drop's pipeline groups (cluster/group.py).
    async_pipeline: bool = False
    # vLLM v1's asynchronous scheduling on one device (engine.py): schedule and prepare step
    # n+1 while the device runs step n. fcfs; no host KV store (its copy stream would not be
    # ordered after a step still in flight). Off by default.
    async_scheduling: bool = False
    # A server makes its outputs (detokenizing, stop strings, each request's snapshot) on a
    # thread of its own, off the engine's (async_engine.py, output_processor.py; vLLM v1 uses a
    # process): on a GPU that host work no longer runs in series with the steps. Neutral on our
    # 2-core CPU (benchmarks/RESULTS.md, "Outputs off the engine's thread"), so on everywhere.
    output_thread: bool = True
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
    # The backend's fused layer ops (Triton: nanoserve/kernels/fused.py; torch on a CPU:
    # nanoserve/kernels/cpu_fused.py); False: PyTorch's ops (an A/B switch)
    fused_layer_ops: bool = True
    # On a CPU, one rank: each linear layer also keeps its weight packed for oneDNN
    # (nanoserve/kernels/cpu_linear.py; the weights' bytes again in RAM). False: F.linear (an A/B switch).
    cpu_packed_linears: bool = True
    # Default sampling parameters (generation_config.py): "auto" reads the model's
    # generation_config.json, "vllm" ignores it, or a directory to read it from; the overrides
    # win over the file (vLLM's --generation-config and --override-generation-config).
    generation_config: str = "auto"
    # A chat template that replaces the model's (a file, or the template's text; vLLM's --chat-template).
    chat_template: str | None = None
    # The reasoning format the model writes (vLLM's --reasoning-parser: "qwen3", "deepseek_r1",
    # both <think>…</think>): the server splits it into reasoning_content, and a request's
    # structured output applies after the reasoning ends. None: the model does not reason.
    reasoning_parser: str | None = None
    # The grammar library for structured outputs (nanoserve/grammar/BACKENDS; vLLM's
    # --structured-outputs-config.backend): llguidance.
    structured_outputs_backend: str = "llguidance"
    override_generation_config: dict | None = None
    calibrate_cost_model: bool = True  # scale the cost model by measured step times (cost_model.py)
    online_slo: SLO | None = None  # the online class's default targets; None: DEFAULT_SLOS
    offline_slo: SLO | None = None


@dataclass(frozen=True)
class Topology:
    """Ranks laid out stage-major: rank = stage · tp + tp_rank. The ranks of one pipeline stage
    form a tensor-parallel group; rank r sends its activations to rank r + tp."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ValueError("tensor_parallel_size and pipeline_parallel_size must be >= 1")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def stage_of(self, rank: int) -> int:
        return rank // self.tensor_parallel_size

    def stage_ranks(self, stage: int) -> list[int]:
        tp = self.tensor_parallel_size
        return list(range(stage * tp, (stage + 1) * tp))


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
        element = dtype.itemsize
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits shared by every policy.

    `max_num_batched_tokens` is the token budget of one step: decode tokens and prefill chunks
    together. `max_model_len` bounds prompt + generated tokens of any single request.
    """

    max_num_batched_tokens: int = EngineArgs.max_num_batched_tokens
    max_num_seqs: int = EngineArgs.max_num_seqs
    max_model_len: int = 2048  # the engine sets it from the model (EngineArgs.max_model_len: None)
    policy: str = EngineArgs.policy
    # Latency targets by request class (see nanoserve/slo.py); a request may override them.
    online_slo: SLO = DEFAULT_SLOS[RequestClass.ONLINE]
    offline_slo: SLO = DEFAULT_SLOS[RequestClass.OFFLINE]
    # Micro-batches a pipelined step runs (nanoserve/parallel/pipeline.py; 1: no pipeline). A policy
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
