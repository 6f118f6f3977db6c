"""Serve a model over the OpenAI API.

    python examples/serve.py                       # the embedded SmolLM2-135M-Instruct on :8000
    python examples/serve.py --model /path/to/hf/model --port 9000 --policy fcfs

    curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"messages": [{"role": "user", "content": "What is the capital of France?"}]}'

Any OpenAI client works: `OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")`.

Parallelism: `--tp 2` (tensor) or `--pp 2` (pipeline), or both, start the extra processes on
this machine. Under torchrun every rank runs this script (tensor size = ranks / --pp); rank 0
serves and the others execute its steps:

    torchrun --nnodes 1 --nproc-per-node 2 examples/serve.py --model DIR
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 4 --master-addr HOST0 examples/serve.py --model DIR
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import uvicorn  # noqa: E402

from nanoserve.async_engine import AsyncEngine  # noqa: E402
from nanoserve.builder import build_engine  # noqa: E402
from nanoserve.config import EngineArgs
from nanoserve.device import resolve_device  # noqa: E402
from nanoserve.parallel.launch import torchrun_rank  # noqa: E402
from nanoserve.parallel.worker import run_worker
from nanoserve.config import Topology
from nanoserve.memory import KV_MANAGER_NAMES  # noqa: E402
from nanoserve.model.attention import ATTENTION_BACKENDS  # noqa: E402
from nanoserve.sched import SCHEDULERS  # noqa: E402
from nanoserve.server import create_app  # noqa: E402
from nanoserve.slo import DEFAULT_SLOS, SLO  # noqa: E402

log = logging.getLogger("nanoserve.serve")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF model directory (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--policy", default="fcfs", choices=sorted(SCHEDULERS), help="scheduling policy (see nanoserve.sched)")
    p.add_argument("--cost-model", default=None, help="iteration cost model JSON from `python -m nanoserve.tools.profile`")
    p.add_argument("--dtype", default=None, help="float32 | float16 | bfloat16 (default: per device)")
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)")
    p.add_argument("--kv-cache-tokens", type=int, default=None,
                   help="KV cache size in tokens (default on CUDA: what the weights and a profiling forward "
                        "leave under --gpu-memory-utilization)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of the GPU's memory the engine may use: weights, activations and KV cache")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--served-model-name", default=None, help="the name clients pass as `model`")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-manager", default=None, choices=sorted(KV_MANAGER_NAMES),
                   help="KV memory manager (default: the policy's own; see nanoserve/memory/__init__.py)")
    p.add_argument("--host-kv-tokens", type=int, default=None,
                   help="host KV store size in tokens, for managers that checkpoint or swap")
    p.add_argument("--host-kv-gb", type=float, default=None,
                   help="...or in GiB of host RAM (default: the device cache's tokens, at most a quarter of RAM)")
    p.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default=None,
                   help="attention kernels (default: triton on CUDA, torch on CPU)")
    p.add_argument("--preempt-every-layers", type=int, default=8,
                   help="conserve: a pure-offline forward checks for an online arrival every k layers")
    p.add_argument("--layerwise-kv-copies", action="store_true",
                   help="stream each step's KV copies layer by layer; a forward waits per layer (BROS §4.1)")
    p.add_argument("--tensor-parallel-size", "--tp", type=int, default=1,
                   help="shard the model over this many processes (under torchrun: the world size)")
    p.add_argument("--pipeline-parallel-size", "--pp", type=int, default=1,
                   help="split the layers into this many pipeline stages, one process (group) each")
    p.add_argument("--async-pipeline", action="store_true",
                   help="with --pp: keep one micro-batch per stage in flight across steps (fcfs, kunserve)")
    p.add_argument("--async-scheduling", action="store_true",
                   help="one device: schedule and prepare the next step while the device runs this one (fcfs)")
    p.add_argument("--mixed-graphs", action="store_true",
                   help="on a GPU: CUDA graphs for steps that mix prompt chunks with decodes too")
    p.add_argument("--online-ttft", type=float, default=DEFAULT_SLOS["online"].ttft,
                   help="seconds to the first token an online request is promised (its class default)")
    p.add_argument("--online-tpot", type=float, default=DEFAULT_SLOS["online"].tpot,
                   help="seconds per later output token an online request is promised")
    p.add_argument("--state-dir", default=None,
                   help="directory that keeps uploaded files and batches across restarts (default: a temporary one)")
    p.add_argument("--max-queued", type=int, default=None,
                   help="online requests that may wait to start; past it they get 429 with Retry-After")
    p.add_argument("--request-timeout", type=float, default=None,
                   help="seconds after which any request is cut off with a 408 (a body's `timeout` may shorten it)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM: seconds to let requests in flight finish before cutting them off")
    p.add_argument("--no-request-log", action="store_true", help="no JSON line per finished request on stderr")
    p.add_argument("--log-level", default="info")
    return p.parse_args(argv)


class DrainingServer(uvicorn.Server):
    """uvicorn, plus: from the first SIGTERM or Ctrl-C on, new requests get 503 and /health
    fails (so a load balancer stops sending), while uvicorn lets the requests in flight finish
    (up to --shutdown-timeout). Then the app's shutdown persists the batches and stops the engine."""

    def __init__(self, config: uvicorn.Config, admission) -> None:
        super().__init__(config)
        self.admission = admission

    def handle_exit(self, sig: int, frame) -> None:
        if not self.admission.draining:
            log.info("signal %d: draining (no new requests; those in flight finish)", sig)
        self.admission.draining = True
        super().handle_exit(sig, frame)


def _exit_after_drain(sig: int, frame) -> None:
    raise SystemExit(0)


def _request_log(enabled: bool) -> None:
    """The request log: bare JSON lines on stderr, one per request, apart from the text log."""
    request_log = logging.getLogger("nanoserve.requests")
    request_log.propagate = False
    request_log.setLevel(logging.INFO if enabled else logging.WARNING)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    request_log.addHandler(handler)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    launched = torchrun_rank()
    if launched is not None:
        rank, world = launched
        topology = Topology(world // args.pipeline_parallel_size, args.pipeline_parallel_size)
        if topology.world_size != world:
            raise SystemExit(f"--pp {args.pipeline_parallel_size} does not divide the {world} torchrun ranks")
        args.tensor_parallel_size = topology.tensor_parallel_size
        if rank != 0:  # a worker: rank 0 sends the plan and every step
            run_worker(rank, topology, resolve_device(args.device))
            return
    # Built on a thread that ends first: the engine thread's OpenMP pool is then the only one
    # (nanoserve/async_engine.py says why that matters on a CPU).
    async_engine = AsyncEngine.build(lambda: build_engine(EngineArgs(
        model=args.model, device=args.device, dtype=args.dtype, policy=args.policy,
        kv_cache_tokens=args.kv_cache_tokens, block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, seed=args.seed, attention_backend=args.attention_backend,
        kv_manager=args.kv_manager, host_kv_tokens=args.host_kv_tokens, cost_model=args.cost_model,
        host_kv_bytes=None if args.host_kv_gb is None else int(args.host_kv_gb * 2**30),
        gpu_memory_utilization=args.gpu_memory_utilization,
        preempt_every_layers=args.preempt_every_layers, layerwise_kv_copies=args.layerwise_kv_copies,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size, async_pipeline=args.async_pipeline,
        async_scheduling=args.async_scheduling, mixed_graphs=args.mixed_graphs, online_slo=SLO(ttft=args.online_ttft, tpot=args.online_tpot),
    )))
    engine = async_engine.engine
    app = create_app(async_engine, served_model_name=args.served_model_name, state_dir=args.state_dir,
                     max_queued=args.max_queued, request_timeout=args.request_timeout)
    _request_log(enabled=not args.no_request_log)
    name = args.served_model_name or async_engine.model_name
    stats = async_engine.stats()
    log.info("model %s: max_model_len %d, KV cache %d blocks of %d tokens", name, async_engine.max_model_len,
             stats.kv_blocks_total, args.block_size)
    log.info("serving on http://%s:%d/v1  (health: /health, metrics: /metrics)", args.host, args.port)
    async_engine.start()
    # uvicorn drains on SIGTERM, then raises the signal again under the handler it found: this
    # one, so that the process still stops the engine (and its workers) below and exits 0.
    signal.signal(signal.SIGTERM, _exit_after_drain)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout)
    try:
        DrainingServer(config, app.state.server.admission).run()
    finally:
        async_engine.shutdown()  # also when uvicorn exits on Ctrl-C or fails to bind
        engine.shutdown()  # and its tensor-parallel workers


if __name__ == "__main__":
    main()
