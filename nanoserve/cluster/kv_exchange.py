"""KunServe's coordinated KV exchange (kunserve.txt §4.2): after a drop regroups instances into a
pipeline, an ongoing request's K/V for the layers its instance no longer holds must move to the
member that now holds them, over the same links the pipeline's activations use.

    sender                                               receiver
    [chunk 0] ──send──►  (scatter into its blocks)
    yield_to(): pending activation sends go first
    [chunk 1] ──send──►  ...

The exchange is cut into chunks of `chunk_bytes`, sized so that one chunk takes about one
pipeline stage's execution time on the link. Between chunks the sender calls `yield_to`, where
the serving loop sends the activations it has ready: activations are small and on the critical
path, the exchange is large and is not, so a stage is never left waiting behind a whole
exchange (the paper's "transfer the activation first and then resume the KVCache transfer").
A request stalls only until its own blocks have arrived. In the cluster (cluster/member.py) the
serving step itself is the yield: each member pair moves one chunk per step, after the step's
activations, and an owner knows from the chunk lists when each of its requests may run again.

A move names (layer, source block, destination block); block tables differ between instances,
so the two sides agree on the list of moves (both derive it from the regroup plan) and the
receiver scatters each chunk where the list says.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nanoserve.parallel import p2p

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor] | None]  # per layer; None: not held here


@dataclass(frozen=True)
class KVMove:
    layer: int
    src_block: int  # in the sender's cache
    dst_block: int  # in the receiver's cache


def _held(kv_caches: KVCaches, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`layer`'s (K, V), which a move names only where it is held."""
    cache = kv_caches[layer]
    assert cache is not None, f"layer {layer} is not held here"
    return cache


def block_bytes(kv_caches: KVCaches) -> int:
    """Bytes of one block of one layer, K and V together."""
    k, _ = next(c for c in kv_caches if c is not None)
    return 2 * k[0].numel() * k.element_size()


def chunk_moves(moves: Sequence[KVMove], bytes_per_block: int, chunk_bytes: int) -> list[list[KVMove]]:
    """Consecutive chunks of at most `chunk_bytes` (at least one move each)."""
    per_chunk = max(1, chunk_bytes // bytes_per_block)
    return [list(moves[i:i + per_chunk]) for i in range(0, len(moves), per_chunk)]


def send_chunk(kv_caches: KVCaches, chunk: Sequence[KVMove], dst: int,
               group: dist.ProcessGroup | None = None) -> int:
    """Send one chunk's blocks (K and V of each move's layer) as one message; returns bytes."""
    buffer = torch.stack([torch.stack((_held(kv_caches, m.layer)[0][m.src_block],
                                       _held(kv_caches, m.layer)[1][m.src_block]))
                          for m in chunk])
    p2p.send(buffer, dst=dst, group=group)
    return buffer.numel() * buffer.element_size()


def recv_chunk(kv_caches: KVCaches, chunk: Sequence[KVMove], src: int,
               group: dist.ProcessGroup | None = None) -> int:
    """Receive what `send_chunk` sent and scatter it into the moves' destination blocks."""
    k_example = next(c for c in kv_caches if c is not None)[0]
    buffer = torch.empty((len(chunk), 2, *k_example.shape[1:]), dtype=k_example.dtype, device=k_example.device)
    p2p.recv(buffer, src=src, group=group)
    for m, kv in zip(chunk, buffer):
        k_cache, v_cache = _held(kv_caches, m.layer)
        k_cache[m.dst_block].copy_(kv[0])
        v_cache[m.dst_block].copy_(kv[1])
    return buffer.numel() * buffer.element_size()


def send_kv(kv_caches: KVCaches, moves: Sequence[KVMove], dst: int, chunk_bytes: int,
            yield_to: Callable[[], None] | None = None, group: dist.ProcessGroup | None = None) -> int:
    """Send the moves' blocks to rank `dst` in chunks, yielding between them; returns bytes sent.
    (The cluster's members send one chunk per serving step instead: cluster/member.py.)"""
    sent = 0
    chunks = chunk_moves(moves, block_bytes(kv_caches), chunk_bytes)
    for i, chunk in enumerate(chunks):
        sent += send_chunk(kv_caches, chunk, dst, group)
        if yield_to is not None and i + 1 < len(chunks):
            yield_to()
    return sent


def recv_kv(kv_caches: KVCaches, moves: Sequence[KVMove], src: int, chunk_bytes: int,
            group: dist.ProcessGroup | None = None) -> int:
    """Receive what `send_kv` sends and scatter it into the moves' destination blocks; returns
    bytes received."""
    return sum(recv_chunk(kv_caches, chunk, src, group)
               for chunk in chunk_moves(moves, block_bytes(kv_caches), chunk_bytes))
