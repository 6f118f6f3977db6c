"""`nanoserve serve [MODEL]`: serve one model over the OpenAI API.

    nanoserve serve                                  # the embedded SmolLM2-135M-Instruct on :8000
    nanoserve serve /path/to/hf/model --port 9000 --policy conserve

    curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"messages": [{"role": "user", "content": "What is the capital of France?"}]}'

Any OpenAI client works: `OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")`.

KunServe's cluster: `--instances N` serves N data-parallel replicas of the model, each in its own
process, behind a dispatcher that sends each request to the instance whose KV it fills least
(nanoserve/cluster/); with `--drop`, a throttled instance drops layers and regroups with a peer
into a pipeline, the memory freed becoming KV, and restores when the burst has passed
(kunserve.txt). /metrics then has the cluster's gauges too (nanoserve_cluster_...).

    nanoserve serve --instances 2 --drop

Across machines, under torchrun: one instance a rank (`--instances` = the world size); rank 0
runs the dispatcher, the monitor and this server, and starts instance 0 beside it; the other
ranks serve as instances 1..N-1 (nanoserve/cluster/torchrun_instances.py):

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 1 --master-addr HOST0 --master-port 29500 \
        -m nanoserve serve --instances 2 --drop DIR        # and --node-rank 1 on HOST1

Parallelism: `--tp 2` (tensor) or `--pp 2` (pipeline), or both, start the extra processes on
this machine. Under torchrun every rank runs this command (tensor size = ranks / --pp); rank 0
serves and the others execute its steps:

    torchrun --nnodes 1 --nproc-per-node 2 -m nanoserve serve DIR
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 4 --master-addr HOST0 -m nanoserve serve DIR
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
from collections.abc import Callable
from types import FrameType

import uvicorn

from nanoserve.async_engine import AsyncEngine
from nanoserve.builder import build_engine
from nanoserve.cluster.cluster import STEPPINGS
from nanoserve.cluster.cluster_engine import ClusterEngine
from nanoserve.cluster.instance_launcher import InstanceLauncher
from nanoserve.cluster.torchrun_instances import TorchrunInstances, serve_instance_rank
from nanoserve.config import EngineArgs, Topology
from nanoserve.device import resolve_device
from nanoserve.engine_flags import add_engine_arguments, engine_args_from
from nanoserve.parallel.launch import torchrun_rank
from nanoserve.parallel.worker import run_worker
from nanoserve.server import create_app
from nanoserve.server.admission import Admission
from nanoserve.server.app import CORSOptions
from nanoserve.server.body_limit import MAX_BODY_BYTES
from nanoserve.serving import ServingEngine

log = logging.getLogger("nanoserve.serve")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The server's own flags, then the engine's (engine_flags.py)."""
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="the name(s) clients pass as `model` (the first is the one responses carry)")
    parser.add_argument("--api-key", action="append", default=None,
                        help="a key clients must send as 'Authorization: Bearer KEY' on /v1 routes (repeat for "
                             "several; also $NANOSERVE_API_KEY)")
    parser.add_argument("--allowed-origins", type=json.loads, default=["*"],
                        help='CORS: origins a browser app may call from, JSON (default: \'["*"]\')')
    parser.add_argument("--allowed-methods", type=json.loads, default=["*"], help="CORS: methods, JSON")
    parser.add_argument("--allowed-headers", type=json.loads, default=["*"], help="CORS: headers, JSON")
    parser.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    parser.add_argument("--state-dir", default=None,
                        help="directory that keeps uploaded files and batches across restarts (default: a temporary "
                             "one)")
    parser.add_argument("--max-queued", type=int, default=None,
                        help="online requests that may wait to start; past it they get 429 with Retry-After")
    parser.add_argument("--request-timeout", type=float, default=None,
                        help="seconds after which any request is cut off with a 408 (a body's `timeout` may shorten "
                             "it)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="on SIGTERM: seconds to let requests in flight finish before cutting them off")
    parser.add_argument("--no-request-log", action="store_true", help="no JSON line per finished request on stderr")
    parser.add_argument("--max-request-body-mb", type=float, default=MAX_BODY_BYTES / 2**20,
                        help="a larger request body gets 413 (file uploads have their own 32 MiB limit)")
    parser.add_argument("--log-stats-interval", type=float, default=10.0,
                        help="seconds between the engine's stats lines in the log while it works (0: none)")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--instances", type=int, default=1,
                        help="serve N replicas of the model, each in its own process, behind KunServe's dispatcher "
                             "(1: one engine in this process; under torchrun one a rank, N = the world size)")
    parser.add_argument("--drop", action="store_true",
                        help="KunServe: a memory-throttled instance drops layers and serves in a pipeline with a peer, "
                             "restoring when the burst has passed (needs --instances 2 or more)")
    parser.add_argument("--cluster-stepping", choices=STEPPINGS, default=STEPPINGS[0],
                        help="lockstep: every instance steps at once, the next step waits for the slowest; "
                             "group_lockstep: each replica or pipeline steps on its own")
    add_engine_arguments(parser)


def check_cluster_flags(instances: int, drop: bool, engine_args: EngineArgs, world: int | None,
                        stepping: str = STEPPINGS[0]) -> None:
    """Refuse a cluster the flags cannot make, before anything is built (SystemExit, the message).
    `world`: torchrun's world size, None without torchrun."""
    if instances < 1:
        raise SystemExit(f"--instances must be at least 1, not {instances}")
    if drop and instances < 2:
        raise SystemExit("--drop needs --instances 2 or more: an instance drops layers that a peer holds, "
                         "and the two serve them as a pipeline")
    if stepping != STEPPINGS[0] and instances < 2:
        raise SystemExit(f"--cluster-stepping {stepping} needs --instances 2 or more: it steps the cluster's "
                         "instances, and one engine has none")
    if instances > 1 and engine_args.async_pipeline and not drop:
        raise SystemExit("--async-pipeline with --instances keeps a drop's pipeline groups' steps in flight; "
                         "it needs --drop")
    if instances > 1 and engine_args.tensor_parallel_size * engine_args.pipeline_parallel_size != 1:
        raise SystemExit("--instances runs each replica in one process; it does not combine with --tp or --pp")
    if instances > 1 and world is not None and instances != world:
        raise SystemExit(f"under torchrun --instances runs one instance a rank: --instances {instances} needs "
                         f"{instances} ranks (--nnodes x --nproc-per-node), and this world has {world}")
    if drop and engine_args.kv_manager not in (None, "arena"):
        raise SystemExit(f"--drop keeps weights and KV in one arena (--kv-manager arena); it does not run on "
                         f"--kv-manager {engine_args.kv_manager}")


class DrainingServer(uvicorn.Server):
    """uvicorn, plus: from the first SIGTERM or Ctrl-C on, new requests get 503 and /health
    fails (so a load balancer stops sending), while uvicorn lets the requests in flight finish
    (up to --shutdown-timeout). Then the app's shutdown persists the batches and stops the engine."""

    def __init__(self, config: uvicorn.Config, admission: Admission) -> None:
        super().__init__(config)
        self.admission = admission

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.admission.start_draining():
            log.info("signal %d: draining (no new requests; those in flight finish)", sig)
        super().handle_exit(sig, frame)


def _exit_after_drain(sig: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def _request_log(enabled: bool) -> None:
    """The request log: bare JSON lines on stderr, one per request, apart from the text log."""
    request_log = logging.getLogger("nanoserve.requests")
    request_log.propagate = False
    request_log.setLevel(logging.INFO if enabled else logging.WARNING)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    request_log.addHandler(handler)


def serve(args: argparse.Namespace) -> None:
    """Run the server the flags of `add_serve_arguments` describe until SIGTERM or Ctrl-C."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine_args = engine_args_from(args)
    launched = torchrun_rank()
    check_cluster_flags(args.instances, args.drop, engine_args, launched[1] if launched is not None else None,
                        args.cluster_stepping)
    launcher: InstanceLauncher | None = None
    if launched is not None and args.instances > 1:  # KunServe's cluster, one instance a rank
        if launched[0] != 0:
            serve_instance_rank()
            return
        launcher = TorchrunInstances()
    elif launched is not None:
        rank, world = launched
        stages = engine_args.pipeline_parallel_size
        topology = Topology(world // stages, stages)
        if topology.world_size != world:
            raise SystemExit(f"--pp {stages} does not divide the {world} torchrun ranks")
        engine_args = dataclasses.replace(engine_args, tensor_parallel_size=topology.tensor_parallel_size)
        if rank != 0:  # a worker: rank 0 sends the plan and every step
            run_worker(rank, topology, resolve_device(engine_args.device))
            return
    # Built on a thread that ends first: the engine thread's OpenMP pool is then the only one
    # (nanoserve/async_engine.py says why that matters on a CPU).
    make_engine: Callable[[], ServingEngine] = (
        (lambda: ClusterEngine.start(engine_args, args.instances, drop=args.drop, launcher=launcher,
                                      stepping=args.cluster_stepping))
        if args.instances > 1
        else (lambda: build_engine(engine_args)))
    async_engine = AsyncEngine.build(make_engine, output_thread=engine_args.output_thread)
    engine = async_engine.engine
    keys = [*(args.api_key or []), *([os.environ["NANOSERVE_API_KEY"]] if os.environ.get("NANOSERVE_API_KEY") else [])]
    cors = CORSOptions(tuple(args.allowed_origins), tuple(args.allowed_methods), tuple(args.allowed_headers),
                       args.allow_credentials)
    app = create_app(async_engine, served_model_name=args.served_model_name, state_dir=args.state_dir,
                     max_queued=args.max_queued, request_timeout=args.request_timeout, api_keys=keys, cors=cors,
                     log_stats_interval=args.log_stats_interval or None,
                     max_body_bytes=int(args.max_request_body_mb * 2**20))
    _request_log(enabled=not args.no_request_log)
    name = (args.served_model_name or [async_engine.model_name])[0]
    stats = async_engine.stats()
    log.info("model %s: max_model_len %d, KV cache %d blocks of %d tokens%s", name, async_engine.max_model_len,
             stats.kv_blocks_total, engine_args.block_size,
             f" on {args.instances} instances{' with KunServe drops' if args.drop else ''}"
             if args.instances > 1 else "")
    log.info("serving on http://%s:%d/v1  (health: /health, metrics: /metrics)%s", args.host, args.port,
             f"; {len(keys)} API key(s) required" if keys else "")
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
        engine.shutdown()  # and its tensor-parallel workers, or the cluster's instances
