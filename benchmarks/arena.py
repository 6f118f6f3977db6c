"""KunServe's arena on a device (issue 47, item 7): what a drop costs, and whether a background
restore's copies run beside the forwards.

1. Drop plus remap. A random-weight model of benchmarks/gpu_models/<name> moves into a
   `MemoryArena`; live KV blocks fill `--kv-fill` of its KV pages; then half the layers are
   dropped (`MemoryArena.drop_layers`: each live block's surviving KV moves down to its new
   rank, the freed pages become KV). Timed from the call to the device being done. The paper
   (KunServe §4.1, §6) reports about 5 ms for the drop with CUDA virtual memory, which remaps
   pages instead of moving KV; our arena moves the live blocks' KV, so the time grows with the
   KV held (printed: the bytes moved).

2. The background restore (§4.4: "we overlap restoring with the normal request processing").
   With no block owned, `begin_restore` reserves the dropped layers' homes and `fill_restore`
   copies `--chunk-mb` at a time from the page-locked host weights on the arena's copy stream.
   Printed: the host's time in one `fill_restore` call (on a GPU it should return long before
   the copy lands), the copy's device time, and a stand-in forward (bf16 GEMMs as long as about
   10 ms) alone and with one fill issued just before it: overlapped, the pair takes about
   max(forward, copy), not their sum.

    PYTHONPATH=. python benchmarks/arena.py --model llama-1b --json out.json    # on a GPU
    PYTHONPATH=. python benchmarks/arena.py --smoke --checkpoint TINY_MODEL       # a CPU: it runs
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.gpu_suite import build_checkpoint
from nanoserve.memory.arena import ArenaConfig, MemoryArena
from nanoserve.model.layer_peer import move_weights_to_host
from nanoserve.model.loader import load_model


def synced(device: torch.device) -> Callable[[], None]:
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def timed_ms(fn: Callable[[], object], sync: Callable[[], None]) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return (time.perf_counter() - start) * 1e3


def stand_in_forward(device: torch.device, smoke: bool) -> Callable[[], torch.Tensor]:
    """bf16 GEMMs of about 10 ms on an H100-class GPU (a few ms of a CPU with --smoke)."""
    n = 256 if smoke else 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    reps = 1 if smoke else 8

    def forward() -> torch.Tensor:
        out = a
        for _ in range(reps):
            out = a @ out
        return out

    return forward


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    sync = synced(device)
    # The GPU suite's random-weight checkpoint of --model (built on the GPU), unless one is given.
    work = Path(args.checkpoint) if args.checkpoint else build_checkpoint(args.model, Path(args.cache))
    model, cfg = load_model(work, device, torch.bfloat16)
    host = move_weights_to_host(model)
    page_tokens = args.block_size
    weight_bytes = sum(t.numel() * t.element_size() for t in host.values())
    page_bytes = ArenaConfig.from_model_config(cfg, page_tokens, torch.bfloat16, 0).page_bytes
    kv_blocks = max(8, int(args.kv_gib * 2**30) // (2 * cfg.num_layers * page_bytes))  # K and V of every layer
    arena = MemoryArena(model, ArenaConfig.from_model_config(cfg, page_tokens, torch.bfloat16, kv_blocks), device)
    live = int(arena.num_free_blocks * args.kv_fill)
    for i in range(live):
        arena.allocate(("seq", i), page_tokens)
    dropped = list(range(1, cfg.num_layers, 2))  # every other layer: a peer holds them (§3)
    # Surviving layer 2k moves from rank 2k to rank k: every one but layer 0, K and V, per live block.
    moved = live * 2 * page_bytes * (cfg.num_layers - len(dropped) - 1)
    drop_ms = timed_ms(lambda: arena.drop_layers(dropped), sync)
    result: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "model": str(work) if args.checkpoint else args.model, "layers": cfg.num_layers,
                    "weight_gib": round(weight_bytes / 2**30, 3), "kv_blocks": kv_blocks, "live_blocks": live,
                    "drop": {"layers": len(dropped), "ms": round(drop_ms, 3),
                             "kv_moved_mib": round(moved / 2**20, 1), "paper_ms_with_vmm": 5}}
    arena.free_all()
    arena.begin_restore(dropped, host)
    chunk = int(args.chunk_mb * 2**20)
    forward = stand_in_forward(device, args.smoke)
    forward_ms = min(timed_ms(forward, sync) for _ in range(3))
    host_ms, copy_ms, pair_ms = [], [], []
    while arena.pull_pages_left and len(pair_ms) < args.fills:
        sync()
        start = time.perf_counter()
        arena.fill_restore(chunk)
        host_ms.append((time.perf_counter() - start) * 1e3)
        sync()
        copy_ms.append((time.perf_counter() - start) * 1e3)
        if not arena.pull_pages_left:
            break
        sync()
        start = time.perf_counter()
        arena.fill_restore(chunk)  # issued, then the forward queued behind it on its own stream
        forward()
        sync()
        pair_ms.append((time.perf_counter() - start) * 1e3)
    restore_ms = timed_ms(lambda: arena.restore_layers(dropped, host), sync)
    arena.check_invariants()

    def median(xs: list[float]) -> float | None:
        return round(statistics.median_low(xs), 3) if xs else None

    result["restore"] = {"chunk_mib": args.chunk_mb, "fill_host_ms": median(host_ms),
                         "fill_device_ms": median(copy_ms), "forward_ms": round(forward_ms, 3),
                         "fill_plus_forward_ms": median(pair_ms),
                         # 1: the pair took max(copy, forward); 0: their sum (None on a CPU: in order)
                         "overlap": (None if not pair_ms or not copy_ms or device.type != "cuda" else
                                     round((median(copy_ms) + forward_ms - median(pair_ms))
                                           / max(min(median(copy_ms), forward_ms), 1e-9), 2)),
                         "switch_ms": round(restore_ms, 3), "pulled_gib": round(arena.pulled_bytes / 2**30, 3)}
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-1b", help="a config under benchmarks/gpu_models/")
    parser.add_argument("--checkpoint", help="a checkpoint to load (default: the GPU suite's random-weight "
                        "checkpoint of --model, built on the GPU under --cache)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--kv-gib", type=float, default=8.0, help="the arena's KV bytes besides the weights")
    parser.add_argument("--kv-fill", type=float, default=0.5, help="the share of KV blocks live at the drop")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--chunk-mb", type=float, default=64.0, help="bytes one fill_restore call copies")
    parser.add_argument("--fills", type=int, default=5, help="fill + forward pairs timed")
    parser.add_argument("--cache", default="/tmp/nanoserve-gpu-models", help="where a built checkpoint goes")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny arena, chunk and stand-in forward (with --checkpoint of a tiny model): a CPU run")
    parser.add_argument("--json")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.smoke and not args.checkpoint:
        parser.error("--smoke needs --checkpoint: a tiny model (the tests build one)")
    if args.smoke:
        args.kv_gib, args.chunk_mb = 0.001, 0.01
    result = run(args)
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
