"""`LocalInstances`: a cluster's instances as processes of this machine, started by the front
(cluster/instance_launcher.py); the default launcher of `Cluster`."""
from __future__ import annotations

from nanoserve.cluster.instance_launcher import InstanceLauncher, free_port, spawn_instance


class LocalInstances(InstanceLauncher):
    """N `python -m nanoserve.cluster.instance` children, connecting over loopback; their gloo
    world meets at a free loopback port."""

    def start(self, front: tuple[str, int], authkey: bytes, num_instances: int) -> str:
        world = f"tcp://127.0.0.1:{free_port()}"
        for i in range(num_instances):
            self.processes.append(spawn_instance(front, authkey, i))
        return world
