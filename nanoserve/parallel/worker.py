"""A worker process of a parallel engine: join the process group, receive rank 0's plan, build
this rank's runner (model/rank.py) and run every step rank 0 posts until it says stop.
`python -m nanoserve.parallel` (started by `WorkerPool`) and, under torchrun, every rank but 0
run `run_worker`.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from nanoserve.config import Topology
from nanoserve.model.rank import build_rank_runner
from nanoserve.parallel.channel import StepChannel
from nanoserve.parallel.executor import worker_loop
from nanoserve.parallel.launch import join_group, rank_device


def run_worker(rank: int, topology: Topology, device: torch.device, init_method: str | None = None) -> None:
    """A worker process: join, receive the plan, build this rank's runner, execute steps until
    told to stop."""
    device = rank_device(device, rank)
    tp, control = join_group(rank, topology, device, init_method)
    try:
        holder: list[Any] = [None]
        dist.broadcast_object_list(holder, src=0, group=control)
        runner = build_rank_runner(holder[0], device, tp, topology.stage_of(rank))
        worker_loop(runner, StepChannel(control, topology.world_size, topology.pipeline_parallel_size > 1),
                    rank, topology)
    finally:
        dist.destroy_process_group()
