"""What the engine runs its steps on: the `Executor` interface and its output. A model runner
(model/runner.py), the driver of worker processes (parallel/executor.py), a pipeline group of
KunServe's cluster (cluster/group.py) and the simulator (sim/executor.py) implement it, so the
engine cannot tell them apart. Every capability beyond `execute` is declared here with the
default an executor without it has; the engine calls these methods and never probes.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from nanoserve.sched.output import SchedulerOutput


class PromptLogprobs(NamedTuple):
    """The prompt logprobs one step computed for a request: `rows[k]` is prompt token
    `first + k`'s {token: logprob} (itself and the top alternatives)."""

    first: int
    rows: list[dict[int, float]]


@dataclass
class ExecutorOutput:
    """The token each sampling request drew this step, keyed by request id."""

    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, dict[int, float]] = field(default_factory=dict)
    # The forward stopped at a safe point (ConServe's layer-wise preemption): nothing was
    # computed that counts, and the engine discards the step.
    preempted: bool = False
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)  # by request id


class Executor:
    """What the engine runs its steps on: a model runner, a driver of worker processes, the
    simulator. `execute` is the one required method; the others are optional capabilities,
    declared here with what an executor without them does."""

    def execute(self, batch: SchedulerOutput) -> ExecutorOutput:
        raise NotImplementedError

    def request_preemption(self) -> None:
        """Stop the pure-offline forward in flight at its next safe point (ConServe Alg. 2's
        PREEMPTRUNNING). Default: nothing, the forward runs to its end (no safe points)."""

    def on_safe_point(self, callback: Callable[[], None] | None) -> None:
        """Call `callback` at each safe point of a preemptible forward, before the preemption
        flag is read (`PreemptionFlag.on_safe_point`): the server's engine loop and the
        simulation admit the requests that arrived meanwhile there, so the policy can ask for
        that very forward to stop (ConServe Alg. 2 runs "on arrival"). None: no callback.
        Default: an executor without safe points never calls it."""

    def shutdown(self) -> None:
        """Stop worker processes and let go of what they hold. Default: nothing to stop."""

    def supports_prompt_logprobs(self) -> bool:
        """Whether steps compute the logprobs of prompt tokens for requests that ask for them
        (`ExecutorOutput.prompt_logprobs`). Default: no (the engine refuses such requests)."""
        return False

    def discard_in_flight(self) -> None:
        """Forget the steps submitted and not collected: the engine gave up on them after a
        failure (their requests are aborted). Default: an executor that keeps none."""


class MicrobatchPipeline(Protocol):
    """An executor that takes a step and returns before its result is ready, so that up to
    `depth` steps are in flight at once (a pipeline's stages each working on a different one).
    Results come back in submission order. nanoserve/parallel/executor.py's `DriverExecutor` is one
    under pipeline parallelism, `ModelRunner` (two deep) one under asynchronous scheduling; the
    engine's pipelined step drives them.

    A `clocked` pipeline advances only when a step is submitted: every submit moves each stage
    one wave on, so the engine submits a step every time it steps, an empty one when the policy
    has nothing to run, and after `depth` submits the oldest result is ready. A KunServe group
    with steps in flight (cluster/group.py) is one: its members' stages hand work on at each
    shared step. Others (`clocked` False) finish what was submitted on their own."""

    depth: int
    clocked: bool

    def submit(self, batch: SchedulerOutput) -> None: ...

    def collect(self) -> ExecutorOutput:
        """The result of the oldest step submitted and not yet collected (waits for it)."""
        ...

    def discard_in_flight(self) -> None:
        """Forget every step submitted and not collected (after a failure)."""
        ...
