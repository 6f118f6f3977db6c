"""How a cluster's instances come to be (cluster/cluster.py). The front (`Cluster`) opens its
control listener, asks its launcher to start or reach the instances, and then talks to them the
same way whoever started them: each instance connects to the listener with the cluster's
authkey, says its id, receives its engine arguments and the gloo world's init method, and serves
messages (cluster/instance.py). Two launchers:

- `LocalInstances` (cluster/local_instances.py): N processes of this machine, started by the
  front (the default; a notebook, a test, `nanoserve serve --instances N`);
- `TorchrunInstances` (cluster/torchrun_instances.py): the ranks of a torchrun world, one
  instance a rank, on as many machines as torchrun spans.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from abc import ABC, abstractmethod

from nanoserve.parallel.launch import stop_processes


class InstanceLauncher(ABC):
    """Starts or reaches a cluster's instances. `processes[i]` is instance i's process for the
    instances this front started itself (all of them on one machine; under torchrun only
    instance 0, the others are torchrun's)."""

    def __init__(self) -> None:
        self.processes: list[subprocess.Popen] = []

    def listen_host(self) -> str:
        """The address the front's control listener binds to."""
        return "127.0.0.1"

    @abstractmethod
    def start(self, front: tuple[str, int], authkey: bytes, num_instances: int) -> str:
        """Start (or reach) every instance, so that each connects to the front's listener, bound
        at `front`, with `authkey`; returns where the instances' gloo world meets (its tcp://
        init method; under torchrun a prefix in torchrun's store)."""

    def assigns_devices(self) -> bool:
        """Whether the front places the instances on its devices (`cluster.instance_devices`).
        False: each instance takes its own node's (torchrun's LOCAL_RANK)."""
        return True

    def kill(self, instance: int) -> None:
        """A dead instance's process, if this front started it: no hung one keeps its device."""
        if instance < len(self.processes):
            self.processes[instance].kill()

    def stop(self, timeout: float = 30.0) -> None:
        """Wait for the started processes to exit (they were told to stop); kill the late ones."""
        stop_processes(self.processes, timeout)


def spawn_instance(front: tuple[str, int], authkey: bytes, instance: int, torchrun: bool = False
                   ) -> subprocess.Popen:
    """`python -m nanoserve.cluster.instance` for `instance`, connecting to the listener at
    `front`; it exits when this process does. `torchrun`: it is a torchrun rank's instance (its
    device and gloo world as cluster/instance.py says)."""
    host, port = front
    return subprocess.Popen([sys.executable, "-m", "nanoserve.cluster.instance", f"{host}:{port}", authkey.hex(),
                             str(instance), str(os.getpid()), *(["--torchrun"] if torchrun else [])])


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
