"""Point-to-point transfers that work on either backend.

Gloo moves host tensors only; NCCL moves device tensors. The cluster's instances join one gloo
world (they may share a GPU, which NCCL does not allow between ranks), so a CUDA tensor goes
through a host copy there: sent from a host copy, received into a host buffer and copied to the
device. Everything else (host tensors, NCCL) passes straight through.

    GPU ──copy──► host ══gloo══► host ──copy──► GPU        (staged: a CUDA tensor over gloo)
    GPU ═══════════════ NCCL ═══════════════► GPU        (direct)
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def staged(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> bool:
    """Must `tensor` go through host memory to travel over `group`?"""
    return tensor.device.type != "cpu" and dist.get_backend(group) == "gloo"


def send(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None, tag: int = 0) -> None:
    dist.send(tensor.cpu() if staged(tensor, group) else tensor, dst=dst, group=group, tag=tag)


def recv(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, tag: int = 0) -> None:
    """Receive into `tensor` (on any device). `tag` (gloo): messages between one pair of ranks
    match in order within a tag, so two streams that interleave (a cluster group's activations
    and logits in flight across steps) each take a tag of their own."""
    if not staged(tensor, group):
        dist.recv(tensor, src=src, group=group, tag=tag)
        return
    host = torch.empty(tensor.shape, dtype=tensor.dtype)
    dist.recv(host, src=src, group=group, tag=tag)
    tensor.copy_(host)


def isend(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None,
          tag: int = 0) -> tuple[dist.Work, torch.Tensor]:
    """Start sending `tensor`; returns the handle and the tensor actually sent, which must stay
    alive until the handle completes."""
    payload = tensor.cpu() if staged(tensor, group) else tensor
    work = dist.isend(payload, dst=dst, group=group, tag=tag)
    assert work is not None, "isend returns no handle only to a rank outside `group`"
    return work, payload
