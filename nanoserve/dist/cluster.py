"""KunServe's cluster (kunserve.txt §3, §4.1): several instances, each a full model replica in
its own process, behind one dispatcher, with a monitor that detects memory throttling.

    requests ─► Dispatcher ─► instance 0 (engine, replica, KV)   python -m nanoserve.dist.instance
                     │    └─► instance 1 ...
                     └── ThrottleMonitor reads every instance's InstanceLoad after each step

- `Dispatcher` (§3's global scheduler, balancing as Llumnix does): a new request goes to the
  instance whose KV would be least full counting what it holds, what its queue's head needs, and
  the new request itself; ties go to the lowest id.
- `ThrottleMonitor` (§3, "memory throttling"): an instance is throttled when the KV its running
  requests hold plus what its head-of-line request needs exceeds its capacity: the head cannot
  run without a preemption. The monitor reports how many blocks each throttled instance is
  short; that is the R of the drop plan (`drop_plan.plan_drop`, Fig. 6).
- `Cluster` starts the instances, routes requests, steps them in lockstep and gathers outputs.

What this module does not do yet: execute a drop plan across instances (drop layers in each
instance's arena, regroup them into pipelines, exchange KV, §4.1-4.2) and restore (§4.4).
`drop_plan.py` already plans both.
"""
from __future__ import annotations

import os
import secrets
import subprocess
import sys
from dataclasses import dataclass, replace
from multiprocessing.connection import Listener
from typing import TYPE_CHECKING, Sequence

from nanoserve.outputs import RequestOutput
from nanoserve.sampling import SamplingParams

if TYPE_CHECKING:
    from nanoserve.builder import EngineArgs


@dataclass(frozen=True)
class InstanceLoad:
    """One instance's KV state after its latest step, in blocks."""

    instance: int
    total_blocks: int
    used_blocks: int
    head_blocks: int  # what the request at the head of its queue needs to start (0: no queue)
    num_waiting: int
    num_running: int

    @property
    def demand_blocks(self) -> int:
        return self.used_blocks + self.head_blocks

    def usage_with(self, blocks: int) -> float:
        """The KV fill if `blocks` more were asked of it (queued demand included)."""
        return (self.demand_blocks + blocks) / self.total_blocks


class Dispatcher:
    """Least-loaded routing by KV demand; `pick` also books the request against the chosen
    instance until its next load report, so a burst does not all land on one instance."""

    def __init__(self) -> None:
        self._booked: dict[int, int] = {}

    def pick(self, loads: Sequence[InstanceLoad], request_blocks: int) -> int:
        if not loads:
            raise ValueError("no instance to dispatch to")
        best = min(loads, key=lambda load: (load.usage_with(request_blocks + self._booked.get(load.instance, 0)),
                                             load.instance))
        self._booked[best.instance] = self._booked.get(best.instance, 0) + request_blocks
        return best.instance

    def reported(self, instance: int) -> None:
        """The instance's load now includes what was booked for it."""
        self._booked.pop(instance, None)


class ThrottleMonitor:
    def short_blocks(self, loads: Sequence[InstanceLoad]) -> dict[int, int]:
        """Blocks each throttled instance lacks (demand over capacity); empty when none is."""
        return {load.instance: load.demand_blocks - load.total_blocks
                for load in loads if load.demand_blocks > load.total_blocks}


class Cluster:
    """N instances of `args` (each a full engine in its own process) behind a dispatcher."""

    def __init__(self, args: EngineArgs, num_instances: int):
        if num_instances < 1:
            raise ValueError("a cluster needs at least one instance")
        if args.tensor_parallel_size * args.pipeline_parallel_size != 1:
            raise ValueError("each instance is one process here; run tensor or pipeline parallelism inside "
                             "an instance in a later version")
        self.args = replace(args, kv_manager_options=None)
        authkey = secrets.token_bytes(16)
        self._listener = Listener(("127.0.0.1", 0), authkey=authkey)
        host, port = self._listener.address
        self.processes = [subprocess.Popen([sys.executable, "-m", "nanoserve.dist.instance", f"{host}:{port}",
                                            authkey.hex(), str(i), str(os.getpid())])
                          for i in range(num_instances)]
        self._connections = {}
        try:
            for _ in range(num_instances):
                connection = self._listener.accept()
                self._connections[connection.recv()] = connection
            for connection in self._connections.values():
                connection.send(self.args)
            self.loads = [self._connections[i].recv() for i in range(num_instances)]
        except BaseException:
            self.shutdown()
            raise
        self.dispatcher = Dispatcher()
        self.monitor = ThrottleMonitor()
        self.placement: dict[str, int] = {}  # request id -> instance
        self.throttle_events: list[dict[int, int]] = []  # the monitor's reports, one per throttled step

    def _call(self, instance: int, *message):
        connection = self._connections[instance]
        connection.send(message)
        reply = connection.recv()
        if isinstance(reply, BaseException):
            raise reply
        return reply

    def add_request(self, request_id: str, token_ids: list[int], params: SamplingParams,
                    priority: str = "online") -> int:
        """Route the request; returns the instance it went to."""
        blocks = -(-len(token_ids) // self.args.block_size)
        instance = self.dispatcher.pick(self.loads, blocks)
        self._call(instance, "add", request_id, token_ids, params, priority)
        self.placement[request_id] = instance
        return instance

    def step(self) -> list[RequestOutput]:
        """One step of every instance; records throttling as the monitor sees it."""
        outputs: list[RequestOutput] = []
        for instance in range(len(self.loads)):
            produced, self.loads[instance] = self._call(instance, "step")
            self.dispatcher.reported(instance)
            outputs.extend(produced)
        short = self.monitor.short_blocks(self.loads)
        if short:
            self.throttle_events.append(short)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return any(load.num_running or load.num_waiting for load in self.loads)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[RequestOutput]:
        ids = [f"cluster-{len(self.placement) + i}" for i in range(len(prompts))]
        for request_id, prompt in zip(ids, prompts):
            self.add_request(request_id, prompt, params)
        finished: dict[str, RequestOutput] = {}
        while len(finished) < len(ids):
            for out in self.step():
                if out.finished:
                    finished[out.request_id] = out
        return [finished[i] for i in ids]

    def shutdown(self) -> None:
        for connection in self._connections.values():
            try:
                connection.send(("stop",))
                connection.recv()
            except (OSError, EOFError):
                pass  # already gone
        for process in getattr(self, "processes", []):
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
        self._connections = {}
        self._listener.close()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()
