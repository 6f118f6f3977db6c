"""One serving instance of a KunServe cluster (nanoserve/cluster/cluster.py): a whole engine, its
own model replica and KV cache, in its own process.

    python -m nanoserve.cluster.instance ADDRESS AUTHKEY_HEX INSTANCE_ID PARENT_PID [--torchrun]

It connects back to the cluster over a socket (`multiprocessing.connection`), receives
the engine arguments and the cluster's gloo world (instance id = rank; a drop's pipelines send
activations and KV point to point in it), builds its engine, then answers messages until told
to stop:

    ("add", Submission)                               -> None
    ("step",)                                         -> (outputs, InstanceLoad, EngineStats, tokens stepped)
    ("drain",)                                        -> the same: every step in flight in its group lands
    ("load",)                                         -> InstanceLoad
    ("abort", request_id)                             -> its final RequestOutput, or None if unknown
    ("take_queued",)                                  -> [Submission]: never-started requests leave (§3)
    ("facts",)                                        -> EngineFacts (what the cluster's front checks with)
    ("reset_prefix_cache",)                           -> blocks forgotten
    ("manifest",) ("reweigh", Relayout) ("allocate", pools) ("exchange", manifests, chunk_bytes)
                                                      -> a drop's or restore's phases (cluster/member.py)
    ("recover",)                                      -> requests requeued (a group peer died)
    ("begin_restore", chunk_bytes) ("retire", ids) ("release", [(owner, ids)]) ("cancel_restore",)
                                                      -> a restore in the background (cluster/restore.py)
    ("stop",)                                         -> None, then exits

Under torchrun (cluster/torchrun_instances.py) the ranks 1..N-1 run `serve` in their own
processes and instance 0 is this module started by rank 0 with `--torchrun`. With `torchrun` an
instance takes its node's GPU LOCAL_RANK, as tensor-parallel ranks do, instead of the device the
front names, and its gloo world meets under the prefix the front names in torchrun's store
(MASTER_ADDR:MASTER_PORT, which every rank reaches) instead of at a tcp:// init method.

A step runs one engine step (if there is work, or if its group's peers have some) and reports
the instance's load, so the dispatcher and the throttling monitor always see the state after
the step. A step that fails because a group peer is gone answers `PeerLost`; the cluster then
sends "recover".
"""
from __future__ import annotations

import os
import sys
from dataclasses import replace
from datetime import timedelta
from multiprocessing.connection import Client, Connection
from typing import Protocol

import torch.distributed as dist

from nanoserve.cluster.engine_facts import EngineFacts
from nanoserve.cluster.load import InstanceLoad, PeerLost
from nanoserve.cluster.member import ClusterMember
from nanoserve.cluster.submission import Submission
from nanoserve.device import resolve_device
from nanoserve.engine import Engine
from nanoserve.parallel.launch import rank_device


class LoadSource(Protocol):
    """What `load_of` reads of an instance: a real one (`ClusterMember`) or a simulated one
    (sim/cluster_layout.py `SimMember`)."""

    id: int
    engine: Engine
    stalled: dict
    replica_blocks: int

    @property
    def exchanging(self) -> bool: ...
    @property
    def capacity_blocks(self) -> int: ...
    @property
    def retired_free(self) -> frozenset[int]: ...
    @property
    def pull_pages_left(self) -> int: ...
    @property
    def restore_pulled_bytes(self) -> int: ...


def load_of(member: LoadSource) -> InstanceLoad:
    """What the dispatcher and the monitor read: blocks held, the blocks the request at the head
    of the queue needs (the monitor's "head-of-line" demand, kunserve.txt §2.2), and the blocks
    every queued request needs (the dispatcher's, Llumnix's virtual usage)."""
    engine: Engine = member.engine
    kv, waiting = engine.kv, engine.scheduler.waiting
    needs = [-(-request.num_tokens // kv.block_size) for request in waiting]
    return InstanceLoad(member.id, member.capacity_blocks, kv.num_used_blocks, needs[0] if needs else 0,
                        sum(needs), len(waiting), engine.scheduler.num_running + len(member.stalled),
                        member.replica_blocks, member.exchanging, member.retired_free, member.pull_pages_left,
                        member.restore_pulled_bytes, engine.steps_in_flight)


def serve(connection: Connection, instance_id: int, torchrun: bool = False) -> None:
    from nanoserve.builder import build_engine_and_runner, shared_device_args

    args, world, timeout_s, sharing = connection.recv()
    if torchrun and (device := resolve_device(args.device)).type == "cuda":
        args = replace(args, device=str(rank_device(device, instance_id)))
    # In a cluster `async_pipeline` keeps a drop's group's steps in flight (cluster/group.py);
    # the instance itself is one device, whose engine steps synchronously while alone.
    engine, runner = build_engine_and_runner(shared_device_args(replace(args, async_pipeline=False), sharing))
    join_world(world, instance_id, timedelta(seconds=timeout_s), torchrun)
    member = ClusterMember(instance_id, engine, runner, pipelined=args.async_pipeline)
    connection.send((load_of(member), member.layer_bytes(), member.replica_block_bytes))
    while True:
        kind, *rest = connection.recv()
        reply: object
        try:
            if kind == "add":
                submission: Submission = rest[0]
                engine.add_request(submission.token_ids, submission.params, submission.request_id,
                                   arrival_time=submission.arrival_time, prompt_text=submission.prompt_text,
                                   priority=submission.priority, slo=submission.slo)
                reply = None
            elif kind in ("step", "drain"):
                try:
                    outputs = member.step() if kind == "step" else member.drain()
                except RuntimeError as exc:
                    if not (member.group is not None or member.exchanging):
                        raise
                    reply = PeerLost(f"instance {instance_id}: a pipeline peer is gone: {exc}")
                else:
                    reply = (outputs, load_of(member), engine.stats(), member.step_tokens)
            elif kind == "load":
                reply = load_of(member)
            elif kind == "abort":
                member.unstall(rest[0])
                reply = engine.abort_request(rest[0])
            elif kind == "take_queued":
                reply = member.take_queued()
            elif kind == "facts":
                reply = EngineFacts.of(engine)
            elif kind == "reset_prefix_cache":
                reply = engine.reset_prefix_cache()
            elif kind == "stop":
                engine.shutdown()
                connection.send(None)
                return
            elif (run_phase := member.phase(kind)) is not None:
                reply = run_phase(*rest)
            else:
                reply = ValueError(f"unknown message {kind!r}")
        except Exception as exc:  # the cluster raises it; this instance keeps serving
            reply = exc
        connection.send(reply)


def join_world(world: tuple[str, int], instance_id: int, timeout: timedelta, torchrun: bool) -> None:
    """Join the instances' gloo world (instance id = rank): `world` is (a tcp:// init method, or
    under torchrun a prefix in torchrun's store, size)."""
    name, size = world
    if not torchrun:
        dist.init_process_group("gloo", init_method=name, rank=instance_id, world_size=size, timeout=timeout)
        return
    # A client of torchrun's store, which its agent (or rank 0, the front) hosts: no rank hosts one here.
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore(name, store), rank=instance_id, world_size=size,
                            timeout=timeout)


if __name__ == "__main__":
    from nanoserve.parallel.launch import exit_with_parent

    address, authkey, instance_arg, parent_arg = sys.argv[1:5]
    exit_with_parent(int(parent_arg))
    host, port = address.rsplit(":", 1)
    with Client((host, int(port)), authkey=bytes.fromhex(authkey)) as conn:
        conn.send(int(instance_arg))
        serve(conn, int(instance_arg), torchrun="--torchrun" in sys.argv[5:])
