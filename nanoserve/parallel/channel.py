"""How rank 0's step messages reach the workers: a broadcast, or, under pipeline parallelism,
point-to-point sends that do not wait for the workers.

    tensor parallelism     rank 0 ──broadcast──► every rank     (all ranks run the step together)
    pipeline parallelism   rank 0 ──isend──► each worker rank   (rank 0 goes on at once)

A gloo broadcast returns on the root only once every rank has joined it (measured: a root whose
peer joins 2 s late waits 2 s). Tensor-parallel ranks join at once, since they run each step
together. A pipeline stage does not: it is still busy with an earlier micro-batch when rank 0
has the next one ready, and an asynchronous pipeline (engine.py) depends on rank 0 going on
to compute that micro-batch's first stage meanwhile. So there each message goes to each worker
as two tensors, its length and its pickled bytes, sent with `isend` and kept alive until the
send completes; a worker receives them in order. Both travel over the control group, a gloo
group, with their own tag, so they never match a send of activations.
"""
from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

CONTROL_TAG = 7  # activations and logits use the default tag 0


class StepChannel:
    """Rank 0's `post` and a worker's `receive`, over `group` (gloo), to ranks 1..world-1."""

    def __init__(self, group: Any, world_size: int, pipelined: bool):
        self.group, self.world_size, self.pipelined = group, world_size, pipelined
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []  # until the workers receive them

    def post(self, message: Any) -> None:
        """Rank 0: send `message` to every worker (returns at once when pipelined)."""
        if not self.pipelined:
            dist.broadcast_object_list([message], src=0, group=self.group)
            return
        self._sends = [s for s in self._sends if not s[0].is_completed()]
        payload = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)
        length = torch.tensor([payload.numel()], dtype=torch.int64)
        for rank in range(1, self.world_size):
            for tensor in (length, payload):
                work = dist.isend(tensor, dst=rank, group=self.group, tag=CONTROL_TAG)
                assert work is not None, "rank 0 is in the control group"
                self._sends.append((work, tensor))

    def receive(self) -> Any:
        """A worker: the next message rank 0 posted."""
        if not self.pipelined:
            holder: list[Any] = [None]
            dist.broadcast_object_list(holder, src=0, group=self.group)
            return holder[0]
        length = torch.empty(1, dtype=torch.int64)
        dist.recv(length, src=0, group=self.group, tag=CONTROL_TAG)
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
        dist.recv(payload, src=0, group=self.group, tag=CONTROL_TAG)
        return pickle.loads(payload.numpy().tobytes())

    def flush(self) -> None:
        """Rank 0: wait until every message posted so far has been received."""
        for work, _ in self._sends:
            work.wait()
        self._sends = []
