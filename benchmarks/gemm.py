"""A model's linear layers at decode batch sizes against the HBM roofline (and cuBLAS against cuBLASLt).

At decode, a linear layer of a small model is a skinny GEMM, [M, K] x [K, N] with M the batch
(1-256): it must read its whole weight, so its floor is the weight's bytes over the peak HBM
bandwidth. A 1B model's QKV weight (12.6 MB) takes 2.6 us at an H200's 4.8 TB/s, about what a
kernel launch costs, and with a 64 x 128 output tile it has only 24 tiles for 132 SMs: such
GEMMs seldom come near the floor. The graphed 1B decode step at batch 64 spends 1.88 ms on the
GPU against a 0.97 ms roofline (benchmarks/RESULTS.md); this measures what share of that the
GEMMs are, shape by shape, so a GPU session can tell them from the attention and the small
kernels (gpu_decode.py --profile gives the same split inside the real step).

Each shape is timed as a CUDA graph of back-to-back calls (so no CPU launch cost counts, as in
the engine's graphed step), cycling through enough copies of the weight that every call reads
it from HBM, not from the L2 cache. The peers: the roofline, and PyTorch's other BLAS library
(`torch.backends.cuda.preferred_blas_library`: cuBLAS, the default, and cuBLASLt).

    python benchmarks/gemm.py [--model benchmarks/gpu_models/llama-1b] [--json out.json]   # a GPU
    python benchmarks/gemm.py --smoke   # tiny shapes on the CPU: checks only, timings mean nothing
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.attention import device_peaks
from nanoserve.model.loader import load_config

ROOT = Path(__file__).resolve().parent.parent
BATCHES = (1, 16, 64, 128, 256)
LIBRARIES = ("cublas", "cublaslt")


@dataclass(frozen=True)
class Shape:
    name: str
    n: int  # output features
    k: int  # input features
    per_forward: int  # how many a forward runs (each layer's, or the LM head's one)


def model_shapes(model_dir: Path) -> list[Shape]:
    """A Llama-shaped model's linear layers as nanoserve runs them (QKV and gate/up merged)."""
    cfg = load_config(model_dir)
    layers, hd = cfg.num_layers, cfg.head_dim
    return [Shape("qkv", (cfg.num_heads + 2 * cfg.num_kv_heads) * hd, cfg.hidden_size, layers),
            Shape("o", cfg.hidden_size, cfg.num_heads * hd, layers),
            Shape("gate_up", 2 * cfg.intermediate_size, cfg.hidden_size, layers),
            Shape("down", cfg.hidden_size, cfg.intermediate_size, layers),
            Shape("lm_head", cfg.vocab_size, cfg.hidden_size, 1)]


@dataclass
class Row:
    shape: str
    library: str
    m: int
    n: int
    k: int
    us: float
    floor_us: float | None  # weight + input + output bytes at peak bandwidth (None: peak unknown)
    fraction_of_peak: float | None


def time_shape(shape: Shape, m: int, dtype: torch.dtype, device: torch.device, l2_bytes: int,
               calls: int = 50) -> float:
    """Microseconds per call, from a graph of `calls` back-to-back F.linear (CUDA), or wall time
    (a CPU: checks only)."""
    weight_bytes = shape.n * shape.k * dtype.itemsize
    copies = max(1, min(64, -(-4 * l2_bytes // weight_bytes)))  # 4x the L2 in weights, cycled
    weights = [torch.randn(shape.n, shape.k, device=device, dtype=dtype) * 0.02 for _ in range(copies)]
    x = torch.randn(m, shape.k, device=device, dtype=dtype)
    out = F.linear(x, weights[0])
    reference = x.float() @ weights[0].float().T
    if not torch.allclose(out.float(), reference, atol=2e-2, rtol=2e-2):
        raise AssertionError(f"{shape.name} at M={m}: F.linear disagrees with the fp32 product")
    if device.type != "cuda":
        start = time.perf_counter()
        for i in range(calls):
            F.linear(x, weights[i % copies])
        return (time.perf_counter() - start) / calls * 1e6
    for i in range(3):  # warm-up, as the engine's capture does (cuda_graphs.py): cuBLAS picks kernels
        F.linear(x, weights[i % copies])
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            F.linear(x, weights[i % copies])
    graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def run(shapes: list[Shape], batches: tuple[int, ...], library: str, dtype: torch.dtype,
        device: torch.device) -> list[Row]:
    """Every shape at every batch under one BLAS library (CUDA; a CPU has one)."""
    _, _, gbs = device_peaks(device)
    l2 = torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else 1 << 20
    rows = []
    if device.type == "cuda":
        torch.backends.cuda.preferred_blas_library(library)
    try:
        for shape in shapes:
            for m in batches:
                us = time_shape(shape, m, dtype, device, l2)
                moved = (shape.n * shape.k + m * (shape.n + shape.k)) * dtype.itemsize
                floor = None if gbs is None else moved / (gbs * 1e9) * 1e6
                rows.append(Row(shape.name, library, m, shape.n, shape.k, round(us, 2),
                                None if floor is None else round(floor, 2),
                                None if floor is None else round(floor / us, 3)))
    finally:
        if device.type == "cuda":
            torch.backends.cuda.preferred_blas_library("cublas")  # PyTorch's default
    return rows


def forward_totals(rows: list[Row], shapes: list[Shape]) -> dict:
    """Per library and batch: the GEMMs of one whole forward (every layer's and the LM head),
    against their floor, in ms."""
    count = {s.name: s.per_forward for s in shapes}
    totals: dict = {}
    for r in rows:
        entry = totals.setdefault(r.library, {}).setdefault(str(r.m), {"ms": 0.0, "floor_ms": 0.0})
        entry["ms"] += r.us * count[r.shape] / 1e3
        entry["floor_ms"] = None if r.floor_us is None or entry["floor_ms"] is None else \
            entry["floor_ms"] + r.floor_us * count[r.shape] / 1e3
    for per_batch in totals.values():
        for entry in per_batch.values():
            floor = entry["floor_ms"]
            entry["fraction_of_peak"] = None if floor is None else round(floor / entry["ms"], 3)
            entry["ms"], entry["floor_ms"] = round(entry["ms"], 4), None if floor is None else round(floor, 4)
    return totals


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT / "benchmarks" / "gpu_models" / "llama-1b"),
                        help="a directory with a Llama-shaped config.json")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16"])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks only")
    parser.add_argument("--json", help="also write the results to this file")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.smoke:
        device, libraries = torch.device("cpu"), ("default",)
        shapes = [Shape("qkv", 96, 64, 2), Shape("down", 64, 128, 2), Shape("lm_head", 512, 64, 1)]
        batches = (1, 4)
    else:
        if not torch.cuda.is_available():
            parser.error("no CUDA device: the benchmark needs a GPU (use --smoke for the CPU check)")
        device, libraries = torch.device("cuda"), LIBRARIES
        shapes, batches = model_shapes(Path(args.model)), tuple(int(b) for b in args.batches.split(","))
    rows, errors, name = [], {}, device_peaks(device)[0]
    for library in libraries:
        try:
            rows += run(shapes, batches, library, getattr(torch, args.dtype), device)
        except (RuntimeError, AssertionError) as e:  # one library failing still reports the other
            errors[library] = f"{type(e).__name__}: {e}"
            print(f"{library}: {errors[library]}")
    totals = forward_totals(rows, shapes)
    print(f"{name}, {args.dtype}{' (CPU smoke: timings mean nothing)' if args.smoke else ''}")
    print(f"{'shape':8} {'library':9} {'M':>4} {'N':>7} {'K':>6} {'us':>9} {'floor us':>9} {'of peak':>8}")
    def cell(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    for r in rows:
        print(f"{r.shape:8} {r.library:9} {r.m:4} {r.n:7} {r.k:6} {r.us:9.2f} {cell(r.floor_us, '9.2f'):>9} "
              f"{cell(r.fraction_of_peak, '8.1%'):>8}")
    for library, per_batch in totals.items():
        for m, entry in per_batch.items():
            print(f"one forward's GEMMs, {library}, batch {m}: {entry['ms']:.3f} ms against "
                  f"{cell(entry['floor_ms'], '.3f')} ms ({cell(entry['fraction_of_peak'], '.0%')} of peak)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "dtype": args.dtype, "date": date.today().isoformat(), "model": args.model,
                       "rows": [asdict(r) for r in rows], "forward": totals, "errors": errors}, f, indent=1)
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
