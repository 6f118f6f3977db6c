"""KunServe's coordinated KV exchange (nanoserve/cluster/kv_exchange.py) between two real gloo
processes: every moved block arrives bit-exact where the move list says, nothing else is
touched, the bytes are accounted, and the sender yields to pending activations between chunks."""
from __future__ import annotations

import json
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanoserve.cluster.kv_exchange import KVMove, block_bytes, chunk_moves, recv_kv, send_kv

LAYERS, BLOCKS, BLOCK, HEADS, DIM = 3, 10, 4, 2, 8
MOVES = [KVMove(1, 3, 0), KVMove(1, 7, 9), KVMove(2, 0, 4), KVMove(2, 5, 5), KVMove(2, 9, 1)]


def sender_caches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    shape = (BLOCKS, BLOCK, HEADS, DIM)
    return [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(LAYERS)]


def run(rank: int, port: int, out_path: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        chunk = int(2.5 * 2 * BLOCK * HEADS * DIM * 4)  # two and a half blocks' worth: chunks of 2
        if rank == 0:
            yields = []
            sent = send_kv(sender_caches(), MOVES, dst=1, chunk_bytes=chunk, yield_to=lambda: yields.append(1))
            result = {"sent": sent, "yields": len(yields)}
        else:
            # The receiver holds layers 1 and 2 only, as a later pipeline stage would.
            shape = (BLOCKS, BLOCK, HEADS, DIM)
            caches = [None] + [(torch.zeros(shape), torch.zeros(shape)) for _ in range(2)]
            received = recv_kv(caches, MOVES, src=0, chunk_bytes=chunk)
            source = sender_caches()
            exact = all(torch.equal(caches[m.layer][i][m.dst_block], source[m.layer][i][m.src_block])
                        for m in MOVES for i in (0, 1))
            moved = {(m.layer, m.dst_block) for m in MOVES}
            untouched = all(not caches[layer][i][b].any() for layer in (1, 2) for b in range(BLOCKS)
                            for i in (0, 1) if (layer, b) not in moved)
            result = {"received": received, "exact": exact, "untouched": untouched}
        with open(f"{out_path}.{rank}", "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def test_chunks_respect_the_byte_budget():
    assert [len(c) for c in chunk_moves(MOVES, 100, 250)] == [2, 2, 1]
    assert [len(c) for c in chunk_moves(MOVES, 100, 10)] == [1] * 5  # a block never splits


def test_two_processes_exchange_blocks_exactly(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "result")
    mp.spawn(run, args=(port, out), nprocs=2, join=True)
    sender = json.loads(open(f"{out}.0").read())
    receiver = json.loads(open(f"{out}.1").read())
    expected_bytes = len(MOVES) * block_bytes(sender_caches())
    assert sender["sent"] == receiver["received"] == expected_bytes
    assert sender["yields"] == 2  # three chunks: the activations went first twice
    assert receiver["exact"] and receiver["untouched"]
