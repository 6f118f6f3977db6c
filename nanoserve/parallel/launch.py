"""Starting and stopping the processes of a tensor-parallel engine.

On one machine, `LLM(..., tensor_parallel_size=N)` (and `serve.py --tp N`) runs the engine in
the caller's process as rank 0 and starts ranks 1..N-1 as `python -m nanoserve.parallel`. Under
`torchrun` the processes already exist: each reads RANK / WORLD_SIZE / MASTER_ADDR from the
environment, rank 0 builds the engine and the others call `run_worker` (`nanoserve serve`, server/serve.py).

Either way a worker joins the process group knowing only its rank and device; rank 0 then
broadcasts a `RankPlan` (the engine arguments, the checkpoint, the KV cache size it decided),
and every worker loads only its shard of the checkpoint, allocates its share of the KV cache
and runs `worker_loop` until rank 0 says stop.

GPUs use NCCL for the model's collectives (rank r on cuda:LOCAL_RANK, or cuda:r), CPUs gloo;
the step messages always travel over a gloo group (see executor.py). A spawned worker watches
its parent and exits when it is gone. A worker that dies makes the next step fail with
`WorkerFailure` instead of hanging: rank 0 checks its children before each step, gloo
collectives fail on a closed peer, and every collective has a timeout.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from nanoserve.config import Topology
from nanoserve.model.parallel import TPGroup
from nanoserve.parallel.channel import StepChannel

if TYPE_CHECKING:
    from nanoserve.model.rank import RankPlan

COLLECTIVE_TIMEOUT = timedelta(seconds=120)  # a lost worker is an error after this, never a hang


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(device: torch.device, rank: int) -> torch.device:
    if device.type != "cuda":
        return device
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())


def join_group(rank: int, topology: Topology, device: torch.device,
               init_method: str | None = None) -> tuple[TPGroup, Any]:
    """Join the default process group; returns (this rank's tensor-parallel group, the gloo
    group that carries step messages)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init_method, rank=rank,
                            world_size=topology.world_size, timeout=COLLECTIVE_TIMEOUT)
    control = dist.new_group(backend="gloo") if device.type == "cuda" else dist.group.WORLD
    tp_size = topology.tensor_parallel_size
    if topology.pipeline_parallel_size == 1:
        return TPGroup(rank, tp_size, dist.group.WORLD), control
    mine = None
    for stage in range(topology.pipeline_parallel_size):  # every rank creates every group, in order
        group = dist.new_group(topology.stage_ranks(stage)) if tp_size > 1 else None
        if stage == topology.stage_of(rank):
            mine = group
    return TPGroup(rank % tp_size, tp_size, mine), control


def send_plan(plan: RankPlan, control: Any) -> None:
    # The workers need no scheduler options (a length predictor may not even pickle).
    dist.broadcast_object_list([replace(plan, args=replace(plan.args, kv_manager_options=None))], src=0,
                               group=control)


class WorkerPool:
    """Ranks 1..N-1 as child processes of rank 0 (the caller).

    They are fresh interpreters (`python -m nanoserve.parallel`), not multiprocessing children: a
    spawned multiprocessing child re-imports the caller's main module, which breaks scripts
    without a `__main__` guard, notebooks and test runners; a fork would copy the caller's
    thread pools and CUDA state."""

    def __init__(self, topology: Topology, device: torch.device):
        self.init_method = f"tcp://127.0.0.1:{_free_port()}"
        sizes = [str(topology.tensor_parallel_size), str(topology.pipeline_parallel_size)]
        self.processes = [subprocess.Popen([sys.executable, "-m", "nanoserve.parallel", str(rank), *sizes, str(device),
                                            self.init_method, str(os.getpid())])
                          for rank in range(1, topology.world_size)]

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.processes)

    def stop(self, timeout: float = 30.0) -> None:
        stop_processes(self.processes, timeout)


def stop_processes(processes: list[subprocess.Popen], timeout: float = 30.0) -> None:
    """Wait for started processes to exit (they were told to stop); kill the late ones."""
    for process in processes:
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def exit_with_parent(parent_pid: int) -> None:
    """A spawned worker outlives its rank 0 only by a moment: it watches for the parent to go."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="nanoserve-parent-watch", daemon=True).start()


def stop_driver(channel: StepChannel, pool: WorkerPool | None) -> None:
    """Rank 0's shutdown: tell the workers to stop (if they can still hear it), wait, leave."""
    if not dist.is_initialized():
        return
    try:
        if pool is None or pool.alive():
            channel.post(None)  # the stop message
            channel.flush()
    except RuntimeError:
        pass  # a worker is already gone: nothing to tell it
    if pool is not None:
        pool.stop()
    dist.destroy_process_group()


def torchrun_rank() -> tuple[int, int] | None:
    """(rank, world size) when started by torchrun, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None
