"""One serving instance of a KunServe cluster (nanoserve/dist/cluster.py): a whole engine, its
own model replica and KV cache, in its own process.

    python -m nanoserve.dist.instance ADDRESS AUTHKEY_HEX INSTANCE_ID PARENT_PID

It connects back to the cluster over a local socket (`multiprocessing.connection`), receives
the engine arguments, builds its engine, then answers messages until told to stop:

    ("add", request_id, token_ids, params, priority)  -> None
    ("step",)                                         -> (outputs, InstanceLoad)
    ("load",)                                         -> InstanceLoad
    ("abort", request_id)                             -> None
    ("stop",)                                         -> None, then exits

A step runs one engine step (if there is work) and reports the instance's load, so the cluster's
dispatcher and throttling monitor always see the state after the step.
"""
from __future__ import annotations

import sys
from multiprocessing.connection import Client

from nanoserve.dist.cluster import InstanceLoad
from nanoserve.engine import Engine


def load_of(instance_id: int, engine: Engine) -> InstanceLoad:
    """What the dispatcher and the monitor read: blocks held, and the blocks the request at the
    head of the queue needs (Llumnix's and KunServe's "head-of-line" demand)."""
    kv, waiting = engine.kv, engine.scheduler.waiting
    head = -(-waiting[0].num_tokens // kv.block_size) if waiting else 0
    return InstanceLoad(instance_id, kv.num_blocks, kv.num_used_blocks, head, len(waiting),
                        engine.scheduler.num_running)


def serve(connection, instance_id: int) -> None:
    from nanoserve.builder import build_engine

    engine = build_engine(connection.recv())
    connection.send(load_of(instance_id, engine))
    while True:
        message = connection.recv()
        kind = message[0]
        if kind == "add":
            _, request_id, token_ids, params, priority = message
            engine.add_request(token_ids, params, request_id, priority=priority)
            connection.send(None)
        elif kind == "step":
            outputs = engine.step() if engine.has_unfinished_requests() else []
            connection.send((outputs, load_of(instance_id, engine)))
        elif kind == "load":
            connection.send(load_of(instance_id, engine))
        elif kind == "abort":
            engine.abort_request(message[1])
            connection.send(None)
        elif kind == "stop":
            engine.shutdown()
            connection.send(None)
            return
        else:
            connection.send(ValueError(f"unknown message {kind!r}"))


if __name__ == "__main__":
    from nanoserve.dist.launch import exit_with_parent

    address, authkey, instance_arg, parent_arg = sys.argv[1:5]
    exit_with_parent(int(parent_arg))
    host, port = address.rsplit(":", 1)
    with Client((host, int(port)), authkey=bytes.fromhex(authkey)) as conn:
        conn.send(int(instance_arg))
        serve(conn, int(instance_arg))
