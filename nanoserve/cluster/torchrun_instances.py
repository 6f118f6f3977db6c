"""KunServe's cluster across machines: one instance a torchrun rank, as tensor and pipeline
parallelism launch theirs (parallel/launch.py):

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 1 --master-addr HOST0 --master-port 29500 \\
        -m nanoserve serve --instances 2 --drop MODEL          # and --node-rank 1 on HOST1

`--instances` equals the world size. Rank 0 is the front: the dispatcher, the throttle monitor,
the regrouper (cluster/cluster.py) and, with `nanoserve serve`, the HTTP server. It runs no
engine itself: it starts instance 0 as a child process on its node (`python -m
nanoserve.cluster.instance`, as the one-machine cluster starts every instance), so the front's
Python never competes with an engine's step loop. Ranks 1..N-1 are instances 1..N-1
(`serve_instance_rank`). Every instance then serves the same messages over the same control
channel as on one machine (cluster/instance.py): a `multiprocessing.connection` to the front's
listener, authenticated with the cluster's authkey.

How the instances find the front: through torchrun's own rendezvous store (the TCPStore every
rank reaches at MASTER_ADDR:MASTER_PORT, `torch.distributed.rendezvous("env://")`). Rank 0 binds
its control listener on every interface and sets one key, `nanoserve/cluster/front/<restart>`,
to its host, port and the authkey; the other ranks wait for that key, connect and say their
rank. No process group is made for it, and rank 0 (the front) joins none. The instances' gloo
world, which carries a drop's activations and KV (instance id = rank), meets in the same store
under a fresh prefix that rank 0 sends with the engine arguments over the control channel
(cluster/instance.py `join_world`); on one machine it meets at a tcp:// port instead. The
authkey travels in the clear through the store: the cluster trusts its network as torchrun's
rendezvous and gloo do.

Rank 0's host as the other nodes reach it (`advertised_host`): $NANOSERVE_CLUSTER_HOST if set;
otherwise the address of this machine's interface on the route to MASTER_ADDR (the network the
rendezvous runs on); where that route is loopback, MASTER_ADDR names this machine, and the other
nodes reached the rendezvous by that name, so it is the one advertised. Gloo picks its own
interfaces (GLOO_SOCKET_IFNAME where the default is wrong).

Devices: each instance takes its node's GPU LOCAL_RANK (cuda), or the CPU, as a tensor-parallel
rank does (`rank_device`); the front assigns none. A rank that dies ends the torchrun job (its
agent stops the others), unlike the one-machine cluster, which recovers (§4.4).
"""
from __future__ import annotations

import ipaddress
import json
import os
import secrets
import socket
from datetime import timedelta
from multiprocessing.connection import Client

import torch.distributed as dist

from nanoserve.cluster.instance import serve
from nanoserve.cluster.instance_launcher import InstanceLauncher, spawn_instance
from nanoserve.parallel.launch import torchrun_rank

HOST_ENV = "NANOSERVE_CLUSTER_HOST"
STARTUP_TIMEOUT = timedelta(minutes=10)  # rank 0 may convert or load the model first


class TorchrunInstances(InstanceLauncher):
    """The launcher of rank 0 of a torchrun world of one instance a rank (the module docstring)."""

    def __init__(self, host: str | None = None) -> None:
        super().__init__()
        launched = torchrun_rank()
        if launched is None:
            raise ValueError("TorchrunInstances runs under torchrun (RANK and WORLD_SIZE are not set)")
        rank, self.world_size = launched
        if rank != 0:
            raise ValueError(f"rank {rank} is an instance (serve_instance_rank); rank 0 is the cluster's front")
        self.host = host or advertised_host()
        self._store: dist.Store | None = None  # kept open: the other ranks read the front's address from it

    def listen_host(self) -> str:
        return "0.0.0.0"  # the other nodes connect to it

    def start(self, front: tuple[str, int], authkey: bytes, num_instances: int) -> str:
        if num_instances != self.world_size:
            raise ValueError(f"under torchrun a cluster runs one instance a rank: {num_instances} instances "
                             f"need {num_instances} ranks, not {self.world_size}")
        port = front[1]
        self._store = rendezvous_store()
        self.processes.append(spawn_instance(("127.0.0.1", port), authkey, 0, torchrun=True))
        self._store.set(front_key(), json.dumps({"host": self.host, "port": port, "authkey": authkey.hex()}))
        return f"nanoserve/cluster/world/{secrets.token_hex(8)}"  # a new world for every cluster

    def assigns_devices(self) -> bool:
        return False


def serve_instance_rank() -> None:
    """A rank other than 0: wait for the front's address in torchrun's store, connect, and serve
    as instance RANK until the front says stop (or is gone)."""
    launched = torchrun_rank()
    if launched is None or launched[0] == 0:
        raise ValueError(f"serve_instance_rank runs on torchrun's ranks 1..N-1, not {launched}")
    store = rendezvous_store()
    store.wait([front_key()], STARTUP_TIMEOUT)
    front = json.loads(store.get(front_key()))
    with Client((front["host"], front["port"]), authkey=bytes.fromhex(front["authkey"])) as connection:
        connection.send(launched[0])
        serve(connection, launched[0], torchrun=True)


def rendezvous_store() -> dist.Store:
    """torchrun's store (env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE), without a process group."""
    store, _, _ = next(dist.rendezvous("env://", timeout=STARTUP_TIMEOUT))
    return store


def front_key() -> str:
    """The store key of the front's address; a restarted job (torchrun --max-restarts) uses a new one."""
    return f"nanoserve/cluster/front/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def advertised_host() -> str:
    """Rank 0's host as the other nodes reach it (the module docstring)."""
    if os.environ.get(HOST_ENV):
        return os.environ[HOST_ENV]
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((master, 9))  # UDP: picks the route, sends nothing
            local = probe.getsockname()[0]
    except OSError:
        return master
    return master if ipaddress.ip_address(local).is_loopback else local
