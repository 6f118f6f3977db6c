"""Scheduling policies. Each is one file; `make_scheduler` picks one by name.

    fcfs      vLLM v1's first-come-first-served with chunked prefill (the baseline)
    prefill-first  vLLM v0's (2023): whole prompts in steps of their own, before decodes
    priority  fcfs with online requests before offline ones, preempting offline at once
    priority-nonselective  online first, but running offline work is never preempted for an
              online arrival, only under memory pressure (ConServe's vLLM++, conserve.txt §3)
    round-robin  RT and BE requests in turns, one class per iteration (bros.txt §2.2; BROS's RR)
    ecoserve  EcoServe's SyncDecoupled scheduling over exact allocation (ecoserve.txt §3)
    bros      BROS's priority packing over bidirectional blocks (bros.txt §4)
    conserve  ConServe's SLO-aware online/offline co-serving (conserve.txt §4.2-4.5)
    kunserve  KunServe's lookahead micro-batches (kunserve.txt §4.3)

A policy works with the KV manager its paper assumes unless the user picks another one:
`POLICY_MEMORY` is that default.
"""
from __future__ import annotations

import importlib
import time
from collections.abc import Callable

from nanoserve.config import SchedulerConfig
from nanoserve.memory.blocks import BlockPool
from nanoserve.memory.manager import KVManager
from nanoserve.sched.base import Scheduler
from nanoserve.sched.cost_model import CostModel
from nanoserve.sched.output import ScheduledChunk, SchedulerOutput

# name -> "module:class", imported on first use.
SCHEDULERS: dict[str, str] = {
    "fcfs": "nanoserve.sched.fcfs:FCFSScheduler",
    "priority": "nanoserve.sched.priority:PriorityScheduler",
    "priority-nonselective": "nanoserve.sched.priority_nonselective:NonSelectivePriorityScheduler",
    "ecoserve": "nanoserve.sched.ecoserve:EcoServeScheduler",
    "bros": "nanoserve.sched.bros:BROSScheduler",
    "conserve": "nanoserve.sched.conserve:ConServeScheduler",
    "kunserve": "nanoserve.sched.kunserve:KunServeScheduler",
    "round-robin": "nanoserve.sched.round_robin:RoundRobinScheduler",
    "prefill-first": "nanoserve.sched.prefill_first:PrefillFirstScheduler",
}
POLICY_MEMORY: dict[str, str] = {
    "fcfs": "paged", "priority": "paged", "priority-nonselective": "swap", "ecoserve": "exact", "bros": "bidirectional",
    "conserve": "checkpoint", "kunserve": "paged", "round-robin": "paged",
    "prefill-first": "paged",
}


def scheduler_class(name: str) -> type[Scheduler]:
    try:
        module_name, cls = SCHEDULERS[name].split(":")
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; available: {', '.join(sorted(SCHEDULERS))}") from None
    return getattr(importlib.import_module(module_name), cls)


def make_scheduler(config: SchedulerConfig, kv: KVManager | BlockPool, cost_model: CostModel | None = None,
                   clock: Callable[[], float] = time.monotonic) -> Scheduler:
    return scheduler_class(config.policy)(config, kv, cost_model=cost_model, clock=clock)


__all__ = ["POLICY_MEMORY", "SCHEDULERS", "Scheduler", "ScheduledChunk", "SchedulerOutput", "make_scheduler",
           "scheduler_class"]
