"""The cluster front's connections to its instances (cluster/cluster.py), with steps that may be
in flight while the front does other work: what lets groups step on their own instead of the
whole cluster in lockstep (`Cluster(stepping="group_lockstep")`, issue 46 item 5; ours).

Each connection carries one message at a time: an instance (cluster/instance.py) reads a
message, answers it, then reads the next. A "step" sent with `start_steps` is left in flight;
the front goes on serving other groups and reads the step's answer when it comes (`wait`).
Any other message to an instance whose step is in flight first takes that step's answer, so a
call never reads a step's answer as its own: `call_all` is the same request/answer round as
before for every caller (the drop's phases, an abort, a new request).

    front ──("step",)──► instance 0  ...the answer is read by `wait`, or by the next call_all
          ──("step",)──► instance 1
          ──("add", …)─► instance 0   (takes instance 0's step answer first, then sends)

Every step answer goes to `on_step_answer(instance, answer)` as it is read, wherever it was
read, so the front books outputs and loads in one place and in the order they came.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from multiprocessing.connection import Connection, wait


class InstanceGone(RuntimeError):
    """The answer of an instance whose process is gone (its connection closed)."""

    def __init__(self, instance: int):
        super().__init__(f"instance {instance} is gone")
        self.instance = instance


class InstanceChannels:
    def __init__(self, on_step_answer: Callable[[int, object], None]):
        self._connections: dict[int, Connection] = {}
        self._on_step_answer = on_step_answer
        self._in_flight: set[int] = set()

    def add(self, instance: int, connection: Connection) -> None:
        """Take the connection of an instance that has just connected (the front's start-up)."""
        assert instance not in self._connections, f"instance {instance} connected twice"
        self._connections[instance] = connection

    @property
    def in_flight(self) -> frozenset[int]:
        """Instances with a step sent and its answer not read yet."""
        return frozenset(self._in_flight)

    def start_steps(self, instances: Iterable[int]) -> None:
        """Send "step" to each instance (none may have one in flight); the answers come later."""
        for instance in instances:
            assert instance not in self._in_flight, f"instance {instance} already has a step in flight"
            try:
                self._connections[instance].send(("step",))
            except OSError:
                self._on_step_answer(instance, InstanceGone(instance))
                continue
            self._in_flight.add(instance)

    def wait(self, done: Callable[[], bool] = lambda: False) -> None:
        """Read step answers as they arrive until `done()` holds after one, or none is in flight."""
        while self._in_flight:
            ready = wait([self._connections[i] for i in sorted(self._in_flight)])
            for instance in sorted(self._in_flight):
                if self._connections[instance] in ready:
                    self._take_step_answer(instance)
            if done():
                return

    def call_all(self, messages: Mapping[int, tuple]) -> dict[int, object]:
        """Send every message, then read every answer: the instances work at once. An instance
        with a step in flight first gives that step's answer (to `on_step_answer`). An instance
        that is gone answers `InstanceGone`."""
        for instance in messages:
            if instance in self._in_flight:
                self._take_step_answer(instance)
        answers: dict[int, object] = {}
        for instance, message in messages.items():
            try:
                self._connections[instance].send(message)
            except OSError:
                answers[instance] = InstanceGone(instance)
        for instance in messages:
            if instance not in answers:
                answers[instance] = self._receive(instance)
        return answers

    def _take_step_answer(self, instance: int) -> None:
        self._in_flight.discard(instance)
        self._on_step_answer(instance, self._receive(instance))

    def _receive(self, instance: int) -> object:
        try:
            return self._connections[instance].recv()
        except (OSError, EOFError):
            return InstanceGone(instance)

    def stop(self) -> None:
        """Tell every instance to stop, after taking any step answer still in flight."""
        for instance in sorted(self._in_flight):
            self._take_step_answer(instance)
        stop_instances(self._connections.values())
        self._connections = {}


def stop_instances(connections: Iterable[Connection]) -> None:
    """Tell each instance to stop and wait for its answer; one already gone is skipped."""
    for connection in connections:
        try:
            connection.send(("stop",))
            connection.recv()
        except (OSError, EOFError):
            pass  # already gone
