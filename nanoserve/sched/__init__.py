"""Scheduling policies. Each is one file; `make_scheduler` picks one by name."""
from __future__ import annotations

from nanoserve.config import SchedulerConfig
from nanoserve.memory.blocks import BlockPool
from nanoserve.memory.manager import KVManager
from nanoserve.sched.base import Scheduler, ScheduledChunk, SchedulerOutput
from nanoserve.sched.fcfs import FCFSScheduler

SCHEDULERS: dict[str, type[Scheduler]] = {"fcfs": FCFSScheduler}


def make_scheduler(config: SchedulerConfig, kv: KVManager | BlockPool) -> Scheduler:
    try:
        cls = SCHEDULERS[config.policy]
    except KeyError:
        raise ValueError(f"unknown policy {config.policy!r}; available: {sorted(SCHEDULERS)}") from None
    return cls(config, kv)


__all__ = ["SCHEDULERS", "Scheduler", "ScheduledChunk", "SchedulerOutput", "make_scheduler"]
