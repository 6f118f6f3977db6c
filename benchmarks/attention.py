"""Paged attention kernels against torch SDPA and the hardware roofline.

For each case this prints our Triton kernel's time, the peer's time and their ratio, plus the
achieved HBM bandwidth (decode) or TFLOP/s (prefill) as a fraction of the device's peak:

- decode: batch 1/64/256 x context 1k/4k/16k, 32 query heads over 8 KV heads, head_dim 128 (a
  Llama-3-8B layer), pages of 16 shuffled through the cache. Peer: SDPA over the same K/V
  stored dense ([batch, kv_heads, context, head_dim], GQA without copying heads). Roofline:
  the bytes of K and V divided by peak HBM bandwidth.
- prefill: one chunk of 512-4096 tokens after a cached prefix of as many tokens. Peer: SDPA
  (flash or memory-efficient, whichever PyTorch dispatches) with a bottom-right causal mask.
- bidirectional cost: the same decode and prefill cases with BROS's direction flags set on
  half of the sequences, against the same case without them.

    python benchmarks/attention.py [--dtype bfloat16] [--json out.json]   # needs a GPU
    python benchmarks/attention.py --smoke   # tiny cases on the CPU under TRITON_INTERPRET=1

The smoke mode runs the same code on tiny shapes, checks every output against the reference
and prints interpreter timings, which say nothing about speed: CI runs it to keep the script
working.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from datetime import date

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernel imports

import torch.nn.functional as F  # noqa: E402
from torch.nn.attention.bias import causal_lower_right  # noqa: E402

from nanoserve.kernels.paged_attention import decode_splits, paged_attention  # noqa: E402

# Dense bf16 tensor-core TFLOP/s and HBM GB/s from NVIDIA's datasheets; first match wins.
DEVICE_PEAKS = [
    ("H200", 989.0, 4800.0), ("H100 NVL", 835.0, 3900.0), ("H100 PCIe", 756.0, 2000.0),
    ("H100", 989.0, 3350.0), ("A100-SXM4-80GB", 312.0, 2039.0), ("A100 80GB PCIe", 312.0, 1935.0),
    ("A100", 312.0, 1555.0), ("L40S", 362.0, 864.0), ("L4", 121.0, 300.0), ("A10", 125.0, 600.0),
]


@dataclass(frozen=True)
class Case:
    kind: str  # "decode" or "prefill"
    batch: int
    context: int  # decode: context per sequence; prefill: prefix + chunk
    chunk: int  # new tokens per sequence
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16


@dataclass
class Result:
    case: Case
    ours_ms: float
    peer_ms: float
    bidirectional_ms: float
    unsplit_ms: float | None  # decode with split-K chosen: the same call without splitting
    achieved: float  # GB/s (decode) or TFLOP/s (prefill)
    fraction_of_peak: float | None
    max_abs_error: float

    @property
    def ratio(self) -> float:
        return self.peer_ms / self.ours_ms


def device_peaks(device: torch.device) -> tuple[str, float | None, float | None]:
    if device.type != "cuda":
        return platform.processor() or platform.machine(), None, None
    name = torch.cuda.get_device_name(device)
    for key, tflops, gbps in DEVICE_PEAKS:
        if key in name:
            return name, tflops, gbps
    return name, None, None


def paged_inputs(case: Case, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """Dense K/V, and the same K/V written into shuffled pages, for `case.batch` sequences."""
    g = torch.Generator(device=device).manual_seed(seed)
    pages = -(-case.context // case.block_size)
    num_blocks = case.batch * pages
    k_dense = torch.randn(case.batch, case.kv_heads, case.context, case.head_dim, device=device, dtype=dtype,
                          generator=g)
    v_dense = torch.randn_like(k_dense)
    tables = torch.randperm(num_blocks, device=device, generator=g).view(case.batch, pages).int()
    k_cache = torch.zeros(num_blocks, case.block_size, case.kv_heads, case.head_dim, device=device, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    positions = torch.arange(case.context, device=device)
    for s in range(case.batch):
        flat = tables[s, positions // case.block_size].long() * case.block_size + positions % case.block_size
        k_cache.view(-1, case.kv_heads, case.head_dim)[flat] = k_dense[s].transpose(0, 1)
        v_cache.view(-1, case.kv_heads, case.head_dim)[flat] = v_dense[s].transpose(0, 1)
    q = torch.randn(case.batch * case.chunk, case.heads, case.head_dim, device=device, dtype=dtype, generator=g)
    seq_lens = torch.full((case.batch,), case.context, device=device, dtype=torch.int32)
    query_start_loc = torch.arange(0, case.batch + 1, device=device, dtype=torch.int32) * case.chunk
    return q, k_cache, v_cache, tables, seq_lens, query_start_loc, k_dense, v_dense


def flip_pages(cache: torch.Tensor, tables: torch.Tensor, seqs: torch.Tensor) -> None:
    """Re-lay `seqs`' pages right to left (BROS), so that directions[s] = True reads the same K/V."""
    pages = tables[seqs].reshape(-1).long()
    cache[pages] = cache[pages].flip(1)


def bench(fn, device: torch.device, repeats: int) -> float:
    """Median milliseconds per call: CUDA events on a GPU, `repeats` wall-clock runs on the CPU."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def run_case(case: Case, dtype: torch.dtype, device: torch.device, repeats: int) -> Result:
    q, k_cache, v_cache, tables, seq_lens, qsl, k_dense, v_dense = paged_inputs(case, dtype, device)
    scale = case.head_dim ** -0.5

    def ours(directions=None):
        return paged_attention(q, k_cache, v_cache, tables, seq_lens, qsl, directions, scale)

    # The peer reads the same K/V laid out dense. Decode: GQA without copying heads. Prefill:
    # heads expanded beforehand (the memory-efficient kernel, which takes bottom-right causal
    # masks, does not take GQA), so the peer is not charged for the copy.
    queries = q.view(case.batch, case.chunk, case.heads, case.head_dim).transpose(1, 2)
    if case.kind == "decode":
        def peer():
            return F.scaled_dot_product_attention(queries, k_dense, v_dense, scale=scale, enable_gqa=True)
    else:
        group = case.heads // case.kv_heads
        k_full, v_full = k_dense.repeat_interleave(group, 1), v_dense.repeat_interleave(group, 1)
        mask = causal_lower_right(case.chunk, case.context)

        def peer():
            return F.scaled_dot_product_attention(queries, k_full, v_full, attn_mask=mask, scale=scale)

    out = ours()
    expected = peer().transpose(1, 2).reshape(out.shape)
    error = float((out.float() - expected.float()).abs().max())
    ours_ms = bench(ours, device, repeats)
    peer_ms = bench(peer, device, repeats)

    # Half the sequences right to left: same K/V, re-laid out, read through the direction flag.
    directions = torch.arange(case.batch, device=device) % 2 == 1
    flip_pages(k_cache, tables, directions.nonzero().squeeze(1))
    flip_pages(v_cache, tables, directions.nonzero().squeeze(1))
    error = max(error, float((ours(directions).float() - out.float()).abs().max()))
    bidirectional_ms = bench(lambda: ours(directions), device, repeats)
    unsplit_ms = None
    if case.kind == "decode" and decode_splits(case.batch, case.kv_heads, device) > 1:
        unsplit_ms = bench(lambda: paged_attention(q, k_cache, v_cache, tables, seq_lens, qsl, None, scale,
                                                   num_splits=1), device, repeats)

    _, peak_tflops, peak_gbps = device_peaks(device)
    if case.kind == "decode":
        kv_bytes = 2 * case.batch * case.context * case.kv_heads * case.head_dim * k_cache.element_size()
        achieved = kv_bytes / (ours_ms * 1e-3) / 1e9
        fraction = achieved / peak_gbps if peak_gbps else None
    else:
        prefix = case.context - case.chunk
        pairs = case.batch * (case.chunk * prefix + case.chunk * (case.chunk + 1) // 2)  # (query, key) pairs seen
        achieved = 4 * pairs * case.heads * case.head_dim / (ours_ms * 1e-3) / 1e12
        fraction = achieved / peak_tflops if peak_tflops else None
    return Result(case, ours_ms, peer_ms, bidirectional_ms, unsplit_ms, achieved, fraction, error)


def cases(smoke: bool) -> list[Case]:
    if smoke:
        tiny = dict(heads=4, kv_heads=2, head_dim=64, block_size=16)
        return [Case("decode", 2, 40, 1, **tiny), Case("prefill", 1, 48, 16, **tiny)]
    decode = [Case("decode", b, c, 1) for b in (1, 4, 16, 64, 256) for c in (1024, 4096, 16384)]
    # Llama-3.2-1B's layer (head_dim 64), the model of issue 22's decode-step goal (batch 64, 1k)
    decode += [Case("decode", 64, c, 1, head_dim=64) for c in (1024, 4096)]
    prefill = [Case("prefill", 1, 2 * c, c) for c in (512, 1024, 2048, 4096)]
    return decode + prefill


def print_table(results: list[Result], device_name: str, dtype: torch.dtype, interpreted: bool) -> None:
    print(f"device: {device_name}; {dtype}; {date.today().isoformat()}")
    if interpreted:
        print("(Triton interpreted on the CPU: a correctness check, its times say nothing about speed)")
    print("| kind | batch | context | chunk | head dim | ours ms | SDPA ms | SDPA/ours | achieved | of peak "
          "| bidir/plain | unsplit ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        unit = "GB/s" if r.case.kind == "decode" else "TFLOP/s"
        peak = f"{r.fraction_of_peak:.0%}" if r.fraction_of_peak is not None else "n/a"
        print(f"| {r.case.kind} | {r.case.batch} | {r.case.context} | {r.case.chunk} | {r.case.head_dim} | "
              f"{r.ours_ms:.3f} | "
              f"{r.peer_ms:.3f} | {r.ratio:.2f}x | {r.achieved:.1f} {unit} | {peak} | "
              f"{r.bidirectional_ms / r.ours_ms:.3f} | "
              f"{'' if r.unsplit_ms is None else f'{r.unsplit_ms:.3f}'} |")


SWEEP = {  # the tile and launch settings --sweep times, per kind of case
    "prefill": [dict(BLOCK_M=m, TILE_N=n, num_warps=w, num_stages=st)
                for m in (64, 128) for n in (32, 64) for w in (4, 8) for st in (2, 3)],
    "decode": [dict(BLOCK_M=16, TILE_N=n, num_warps=w, num_stages=st) for n in (32, 64, 128) for w in (2, 4)
               for st in (2, 3, 4)],
}
SWEEP_SPLITS = (2, 4)  # decode: also the context cut into this many parts (split-K), default tiles
# Small decode batches, which split-K serves: the fewest positions a split takes
# (paged_attention's `min_split_tokens`, MIN_SPLIT_TOKENS by default), 0 for no minimum.
SWEEP_MIN_SPLIT = (0, 128, 256, 512)


# A prefill case and two decode cases: head_dim 128, and 64 (Llama-3.2-1B's layer, the model of
# the decode-step goal); then split-K's cases, batch 1 and 16 at 1k (where it lost to the unsplit
# kernel on an H200) and batch 1 at 16k (where it won 11x).
SWEEP_CASES = [Case("prefill", 1, 4096, 2048), Case("decode", 64, 1024, 1), Case("decode", 64, 1024, 1, head_dim=64)]
SPLIT_SWEEP_CASES = [Case("decode", 1, 1024, 1), Case("decode", 16, 1024, 1), Case("decode", 1, 16384, 1)]


def sweep(dtype: torch.dtype, device: torch.device) -> list[dict]:
    """Our kernel's time under each SWEEP setting (an error, e.g. too much shared memory, is
    recorded as such) for each of SWEEP_CASES, decode also split (SWEEP_SPLITS): the data to
    pick defaults from."""
    rows = []
    for case in SWEEP_CASES:
        q, k_cache, v_cache, tables, seq_lens, qsl, _, _ = paged_inputs(case, dtype, device)
        scale = case.head_dim ** -0.5
        default_ms = bench(lambda: paged_attention(q, k_cache, v_cache, tables, seq_lens, qsl, None, scale),
                           device, 3)
        settings = SWEEP[case.kind] + ([dict(num_splits=n) for n in SWEEP_SPLITS] if case.kind == "decode" else [])
        label = f"{case.kind} {case.batch}x{case.context} head_dim {case.head_dim}"
        for tuning in settings:
            splits = tuning.get("num_splits")
            launch = None if splits is not None else tuning
            try:
                ms = bench(lambda: paged_attention(q, k_cache, v_cache, tables, seq_lens, qsl, None, scale,
                                                   num_splits=splits, tuning=launch), device, 3)
            except Exception as e:  # noqa: BLE001 - a setting that does not compile is a result
                ms = f"{type(e).__name__}"
            rows.append(asdict(case) | {"tuning": tuning, "ms": ms, "default_ms": default_ms})
            print(f"{label}: {tuning} {ms if isinstance(ms, str) else f'{ms:.4f}'} ms (default {default_ms:.4f})",
                  flush=True)
        timed = [r for r in rows if r["kind"] == case.kind and r["context"] == case.context
                 and r["head_dim"] == case.head_dim and isinstance(r["ms"], float)]
        best = min(timed, key=lambda r: r["ms"], default=None)
        print(f"{label}: default {default_ms:.3f} ms, best "
              + ("none compiled" if best is None else f"{best['ms']:.3f} ms with {best['tuning']}"), flush=True)
    return rows + split_sweep(dtype, device)


def split_sweep(dtype: torch.dtype, device: torch.device) -> list[dict]:
    """Split-K's minimum positions per split (SWEEP_MIN_SPLIT) on SPLIT_SWEEP_CASES, the split
    count as `decode_splits` picks it, beside the unsplit kernel: the data for MIN_SPLIT_TOKENS."""
    rows = []
    for case in SPLIT_SWEEP_CASES:
        q, k_cache, v_cache, tables, seq_lens, qsl, _, _ = paged_inputs(case, dtype, device)
        scale = case.head_dim ** -0.5
        unsplit_ms = bench(lambda: paged_attention(q, k_cache, v_cache, tables, seq_lens, qsl, None, scale,
                                                   num_splits=1), device, 3)
        splits = decode_splits(case.batch, case.kv_heads, device)
        label = f"decode {case.batch}x{case.context} head_dim {case.head_dim}, {splits} splits"
        for min_split in SWEEP_MIN_SPLIT:
            ms = bench(lambda: paged_attention(q, k_cache, v_cache, tables, seq_lens, qsl, None, scale,
                                               min_split_tokens=min_split), device, 3)  # noqa: B023
            rows.append(asdict(case) | {"tuning": {"min_split_tokens": min_split}, "ms": ms, "unsplit_ms": unsplit_ms})
            print(f"{label}: min {min_split} positions a split {ms:.4f} ms (unsplit {unsplit_ms:.4f})", flush=True)
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny cases on the CPU (interpreted); checks only")
    parser.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--sweep", help="time tile/launch settings instead, writing them to this JSON file")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.sweep:
        if not torch.cuda.is_available():
            parser.error("--sweep needs a GPU")
        with open(args.sweep, "w") as f:
            json.dump(sweep(getattr(torch, args.dtype), torch.device("cuda")), f, indent=1)
        return 0

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type == "cpu" and not args.smoke:
        parser.error("no CUDA device: the benchmark needs a GPU (use --smoke for the CPU check)")
    dtype = torch.float32 if args.smoke else getattr(torch, args.dtype)
    results = [run_case(case, dtype, device, repeats=3) for case in cases(args.smoke)]
    name, _, _ = device_peaks(device)
    print_table(results, name, dtype, interpreted=device.type == "cpu")

    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    worst = max(r.max_abs_error for r in results)
    print(f"largest difference from SDPA (and between layouts): {worst:.2e} (tolerance {tolerance:g})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "dtype": str(dtype), "date": date.today().isoformat(),
                       "results": [asdict(r.case) | {k: v for k, v in vars(r).items() if k != "case"}
                                   for r in results]}, f, indent=2)
    return 0 if worst <= tolerance else 1


if __name__ == "__main__":
    raise SystemExit(main())
