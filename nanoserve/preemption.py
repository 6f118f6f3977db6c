"""ConServe's layer-wise preemption of a pure-offline forward (conserve.txt §4.3, §5): the
flag its scheduler shares with the worker, and the exception a safe point raises. The runner
arms the flag's safe points while it runs a pure-offline batch (`ModelRunner.run_model`); the
simulator's executor passes the same safe points in virtual time (sim/executor.py).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from nanoserve.config import EngineArgs


class ForwardPreempted(Exception):
    """Raised by a safe point to abandon the forward pass; `ModelRunner.execute` catches it."""


@dataclass
class PreemptionFlag:
    """The `preempted` flag ConServe's scheduler shares with its worker (§4.3, §5).

    `request()` asks the forward in flight to stop (it may be called from another thread: it
    only sets a bool). The model calls `safe_point(layers_done)` after each layer, but only
    while the runner has installed it, i.e. during a pure-offline batch (the paper's
    `preemptible` flag: safe points are off, at zero cost, otherwise). A safe point every
    `every` layers (the paper's default is eight) raises `ForwardPreempted` if a preemption was
    requested; after the last layer it never does (the forward is done: finishing it is cheaper
    than redoing it). A request is consumed by the forward it stops, or dropped when a forward
    ends without stopping: the engine schedules again at once and sees the arrival then.
    Under tensor parallelism only rank 0 is asked; `agree` is the paper's barrier across the
    workers (an all-reduce at each safe point), so every rank stops at the same layer.
    """

    every: int = EngineArgs.preempt_every_layers
    num_layers: int = 0
    # Called at each safe point before the flag is read. The server's engine loop sets it to
    # admit the requests that arrived since the step began (Alg. 2 runs "on arrival"), so the
    # policy can ask for this very forward to stop. It runs on the thread running the forward.
    on_safe_point: Callable[[], None] | None = None
    agree: Callable[[bool], bool] | None = None  # whether any rank was asked (tensor parallelism)
    # Called first at each checked safe point: blocks until the device has run every layer
    # launched so far (`ModelRunner` sets it on CUDA). Without it the check means nothing on a
    # GPU: the CPU queues kernels far ahead of the GPU, so by the time a preemption arrives the
    # whole forward is usually queued and stopping the launches saves no GPU time. The price is
    # one pipeline drain per check: while the CPU launches the next layers' kernels the GPU
    # idles, a few hundred microseconds per check in eager mode (launches of one layer), so
    # num_layers / every drains per preemptible forward (4 for 32 layers at the default 8).
    wait_for_device: Callable[[], None] | None = None
    requested: bool = False
    stopped_after: int | None = None  # layers the last preempted forward had completed
    num_preempted: int = 0  # forwards stopped so far

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError("preempt_every_layers must be >= 1")

    def request(self) -> None:
        self.requested = True

    def safe_point(self, layers_done: int) -> None:
        if layers_done % self.every or layers_done >= self.num_layers:
            return
        if self.wait_for_device is not None:
            self.wait_for_device()
        if self.on_safe_point is not None:
            self.on_safe_point()
        if self.agree(self.requested) if self.agree is not None else self.requested:
            self.requested = False
            self.stopped_after = layers_done
            self.num_preempted += 1
            raise ForwardPreempted(layers_done)
