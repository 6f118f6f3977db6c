"""One model on one GPU: its decode step against the HBM roofline, or a served batch of requests.

    PYTHONPATH=. python3 -m benchmarks.gpu_decode --model DIR [--batch 64 --context 1024] [--json out.json]
    PYTHONPATH=. python3 -m benchmarks.gpu_decode --model DIR --serve 200 [--json out.json]

Decode: `batch` requests with `context`-token prompts are prefilled, then each decode step (all
of them decoding) is timed from the engine's side, `engine.step()` to `engine.step()`, so
scheduling, input preparation, the forward and sampling all count. The roofline is the bytes a
step must read from HBM, every weight once plus every sequence's K and V, over the device's peak
bandwidth (benchmarks/attention.py's datasheet table).

With `--async-scheduling` the engine keeps two steps in flight (vLLM v1's asynchronous
scheduling): a step's host work (scheduling, preparing, post-processing) runs while the GPU runs
the step before, so the timed step approaches the forward's GPU time.

Serve: the engine sizes its KV cache itself (weights loaded first, then a profiling forward and
its CUDA graphs recorded over a small cache) and serves `serve` requests (prompts 64-512 tokens,
outputs 64-256, greedy, EOS ignored); it reports the start-up time, the KV cache, throughput, the
peak memory and what share of the device the built engine took (`--mixed-graphs`,
`--async-scheduling`, `--eager` as for decode).

`--device cpu` checks that the script runs (tests/test_gpu_scripts.py): the same engine path, its
CUDA-graph steps through the graphs' static buffers without recording, and no memory figures.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.attention import DEVICE_PEAKS
from nanoserve import LLM, SamplingParams
from nanoserve.builder import kv_block_bytes
from nanoserve.config import EngineArgs
from nanoserve.model.cuda_graphs import decode_buckets, mixed_buckets
from nanoserve.model.loader import load_config


def peak_bandwidth(name: str) -> float:
    """Bytes per second."""
    for key, _, gbs in DEVICE_PEAKS:
        if key in name:
            return gbs * 1e9
    raise ValueError(f"no HBM peak known for {name}")


def device_name(device: str) -> str:
    return torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "H100 (CPU stand-in)"


def graph_stand_in(args, max_num_seqs: int, max_num_batched_tokens: int) -> dict:
    """On a CPU, the graph sizes the GPU would record, so the stand-in runs the same path through
    the static buffers (without recording, cuda_graphs.py); on CUDA nothing: the engine's own."""
    if args.device.startswith("cuda") or args.eager:
        return {}
    mixed = tuple(mixed_buckets(max_num_seqs, max_num_batched_tokens)) if args.mixed_graphs else None
    return {"decode_graph_sizes": tuple(decode_buckets(max_num_seqs)), "mixed_graph_sizes": mixed}


def prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(17, vocab, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def decode(args) -> dict:
    cfg = load_config(Path(args.model))
    start = time.perf_counter()
    budget = max(2048, args.context)
    llm = LLM(args.model, device=args.device, dtype="bfloat16", max_num_seqs=args.batch,
              max_num_batched_tokens=budget, enforce_eager=args.eager,
              fused_layer_ops=not args.unfused, async_scheduling=args.async_scheduling,
              kv_cache_tokens=args.kv_cache_tokens, mixed_graphs=args.mixed_graphs,
              **graph_stand_in(args, args.batch, budget))
    startup = time.perf_counter() - start
    engine = llm.engine
    if args.stub_forward:
        stub_forward(engine.executor, cfg.hidden_size)
    # Enough tokens that no request ends before the timed steps do: the first prompts start
    # decoding while the last are still being prefilled.
    prefill_steps = -(-args.batch * args.context // budget)
    params = SamplingParams(temperature=0, max_tokens=prefill_steps + args.steps + 8, ignore_eos=True)
    for p in prompts(args.batch, args.context, args.context, cfg.vocab_size, 0):
        engine.add_request(p, params)
    started: set[str] = set()
    while len(started) < args.batch:  # prefill everyone
        for out in engine.step():
            started.add(out.request_id)
    phases = PhaseTimers(engine)
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    phases.remove()
    running = engine.stats().num_running
    if running < args.batch:
        raise RuntimeError(f"only {running} of {args.batch} requests fit: raise --kv-cache-tokens")
    model = engine.executor.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    token_bytes = kv_block_bytes(EngineArgs(), cfg, torch.bfloat16) // 16
    ctx = args.context + args.steps // 2
    kv_bytes = args.batch * ctx * token_bytes
    bw = peak_bandwidth(device_name(args.device))
    roofline = (weight_bytes + kv_bytes) / bw
    step = statistics.median(times)
    graphs = engine.executor.graphs
    kernels = kernel_table(engine, args.batch, top=10_000) if args.profile else None
    return {"mode": "decode", "model": str(args.model), "batch": args.batch, "context": args.context,
            "steps": args.steps, "eager": args.eager, "async_scheduling": args.async_scheduling,
            "mixed_graphs": args.mixed_graphs,
            "stub_forward": args.stub_forward,
            "fused_layer_ops": not args.unfused,
            "graph_replays": 0 if graphs is None else graphs.num_replays,
            "startup_s": round(startup, 2), "step_ms_median": round(step * 1e3, 3),
            "step_ms_p10": round(sorted(times)[len(times) // 10] * 1e3, 3),
            "weight_gib": round(weight_bytes / 2**30, 3), "kv_gib": round(kv_bytes / 2**30, 3),
            "roofline_ms": round(roofline * 1e3, 3), "step_over_roofline": round(step / roofline, 2),
            "phase_ms_median": phases.medians(),
            "forward_gpu_ms": None if graphs is None or args.device == "cpu" else forward_gpu_ms(graphs, args.batch),
            "kernels": None if kernels is None else kernels[: 15],
            "kernel_classes": None if kernels is None else kernel_classes(kernels, weight_bytes, kv_bytes, bw)}


def stub_forward(runner, hidden_size: int) -> None:
    """Replace the model's forward and LM head by fixed zeros (8 logits a row): what a step
    then costs is the host's share alone (scheduling, preparing, sampling's bookkeeping,
    post-processing), the part asynchronous scheduling hides under the device's forward."""
    if runner.graphs is not None:
        raise ValueError("--stub-forward runs eagerly: add --eager")
    zeros = torch.zeros(1 << 16, hidden_size, device=runner.device, dtype=torch.bfloat16)
    logits = torch.zeros(1 << 16, 8, device=runner.device)
    runner.run_model = lambda prepared, preemptible=False, hidden=None: zeros[: prepared.input_ids.shape[0]]
    runner.model.compute_logits = lambda h: logits[: h.shape[0]]


def kernel_table(engine, batch: int, steps: int = 10, top: int = 15) -> list[dict]:
    """Where a decode step's GPU time goes, by kernel (torch.profiler, CUDA activity): per step,
    each kernel name's total time and launch count, the `top` largest. Graphed: replays of the
    static buffers (the forward and LM head); eager: whole engine steps."""
    from torch.profiler import ProfilerActivity, profile

    graphs = engine.executor.graphs
    bucket = None if graphs is None else graphs.bucket_for(batch)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            if bucket is not None and graphs.record:
                graphs.replay_static(bucket)
            else:
                engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        device_us = event.self_device_time_total  # a kernel's own GPU time
        if device_us > 0 and event.device_type == torch.autograd.DeviceType.CUDA:
            rows.append({"kernel": event.key[:120], "ms_per_step": round(device_us / 1e3 / steps, 4),
                         "launches_per_step": round(event.count / steps, 1)})
    return sorted(rows, key=lambda r: -r["ms_per_step"])[:top]


# Which part of a decode step a kernel belongs to, by the first pattern its name contains (cuBLAS
# names its GEMMs after the architecture: sm90_xmma_gemm, nvjet, cutlass; ours are Triton's).
KERNEL_CLASSES = (("attention", ("paged_attention", "paged_decode", "combine_splits")),
                  ("store_kv", ("store_kv",)),
                  ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "splitk", "cublas")),
                  ("fused ops", ("rms_norm", "rope", "silu")))


def kernel_classes(kernels: list[dict], weight_bytes: int, kv_bytes: int, bandwidth: float) -> dict:
    """The step's GPU time by part, each against the bytes it must move at peak bandwidth: the
    GEMMs read every weight once (the LM head included), the attention every sequence's K and
    V; the rest (norms, RoPE, the KV store, copies, sampling's kernels) moves little and is
    mostly fixed cost per kernel. Tells the next GPU session where the forward's gap is."""
    totals: dict[str, list[float]] = {}
    for k in kernels:
        name = k["kernel"].lower()
        part = next((label for label, keys in KERNEL_CLASSES if any(key in name for key in keys)), "other")
        ms, launches = totals.setdefault(part, [0.0, 0.0])
        totals[part] = [ms + k["ms_per_step"], launches + k["launches_per_step"]]
    floors = {"gemm": weight_bytes / bandwidth * 1e3, "attention": kv_bytes / bandwidth * 1e3}
    return {part: {"ms_per_step": round(ms, 4), "launches_per_step": round(launches, 1),
                   **({"roofline_ms": round(floors[part], 4), "fraction_of_peak": round(floors[part] / ms, 3)}
                      if part in floors and ms > 0 else {})}
            for part, (ms, launches) in sorted(totals.items(), key=lambda item: -item[1][0])}


class PhaseTimers:
    """Where a step's wall time goes, read from the engine's side: the scheduler's `schedule`,
    the runner's `prepare` (the batch's inputs), the executor's `execute` (prepare, the forward's
    launch or graph replay, sampling and its one sync: so it includes waiting for the GPU), and the
    engine's post-processing (detokenizing, stop checks, outputs). Under asynchronous scheduling
    `execute` is not called: `launch` (prepare, the launches, sampling queued) and `land` (the wait
    for the previous step's tokens) split it. Wrappers on the instances, removed after the timed
    steps."""

    def __init__(self, engine) -> None:
        self.samples: dict[str, list[float]] = {}
        self._wrapped = []
        runner = engine.executor
        for name, owner, attr in (("schedule", engine.scheduler, "schedule"), ("prepare", runner, "prepare"),
                                  ("execute", runner, "execute"), ("launch", runner, "launch"),
                                  ("land", runner, "land"), ("postprocess", engine, "_postprocess")):
            self._wrap(name, owner, attr)

    def _wrap(self, name: str, owner, attr: str) -> None:
        inner = getattr(owner, attr)
        bucket = self.samples.setdefault(name, [])

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                bucket.append(time.perf_counter() - t)

        setattr(owner, attr, timed)
        self._wrapped.append((owner, attr))

    def remove(self) -> None:
        for owner, attr in self._wrapped:
            delattr(owner, attr)  # the instance attribute goes; the class's method shows again

    def medians(self) -> dict[str, float]:
        return {k: round(statistics.median(v) * 1e3, 3) for k, v in self.samples.items() if v}


def forward_gpu_ms(graphs, batch: int, replays: int = 20) -> float:
    """The GPU time of one graphed decode forward (+ LM head) at this batch's bucket, by CUDA
    events around back-to-back replays of the static buffers the last step left (their KV
    writes repeat that step's): what the step would cost with no CPU work at all."""
    bucket = graphs.bucket_for(batch)
    graphs.replay_static(bucket)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graphs.replay_static(bucket)
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) / replays, 3)


def device_memory(device: str) -> tuple[int, int] | None:
    """(free, total) bytes of the device; None on a CPU (the stand-in reports no memory)."""
    return torch.cuda.mem_get_info(torch.device(device).index) if device.startswith("cuda") else None


def gib(n: int | None, digits: int = 1) -> float | None:
    return None if n is None else round(n / 2**30, digits)


def serve(args) -> dict:
    cfg = load_config(Path(args.model))
    before = device_memory(args.device)
    start = time.perf_counter()
    llm = LLM(args.model, device=args.device, dtype="bfloat16", enforce_eager=args.eager,
              async_scheduling=args.async_scheduling, mixed_graphs=args.mixed_graphs,
              kv_cache_tokens=args.kv_cache_tokens,
              **graph_stand_in(args, EngineArgs.max_num_seqs, EngineArgs.max_num_batched_tokens))
    startup = time.perf_counter() - start
    graphs = llm.engine.executor.graphs
    stats = llm.engine.stats()
    token_bytes = kv_block_bytes(EngineArgs(), cfg, torch.bfloat16) // 16
    after = device_memory(args.device)
    ps = prompts(args.serve, *args.prompt_range, cfg.vocab_size, 1)
    g = torch.Generator().manual_seed(2)
    lo, hi = args.output_range
    params = [SamplingParams(temperature=0, max_tokens=int(torch.randint(lo, hi + 1, (1,), generator=g)),
                             ignore_eos=True) for _ in ps]
    t = time.perf_counter()
    outs = llm.generate(ps, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    produced = sum(len(o.token_ids) for o in outs)
    assert produced == sum(p.max_tokens for p in params)
    on_cuda = before is not None and after is not None
    return {"mode": "serve", "requests": args.serve, "startup_s": round(startup, 2),
            "mixed_graphs": args.mixed_graphs, "async_scheduling": args.async_scheduling,
            "kv_blocks": stats.kv_blocks_total, "kv_tokens": stats.kv_blocks_total * 16,
            "kv_gib": round(stats.kv_blocks_total * 16 * token_bytes / 2**30, 2),
            "device_gib": gib(before[1]) if on_cuda else None, "free_before_gib": gib(before[0]) if on_cuda else None,
            "free_after_build_gib": gib(after[0]) if on_cuda else None,
            # what the engine took, graphs and all, against gpu_memory_utilization (0.9)
            "build_used_fraction": round((before[0] - after[0]) / before[1], 3) if on_cuda else None,
            "graphs": None if graphs is None else {"decode": len(graphs.buckets), "mixed": len(graphs.mixed_sizes),
                                                   "decode_replays": graphs.num_replays,
                                                   "mixed_replays": graphs.num_mixed_replays},
            "max_allocated_gib": gib(torch.cuda.max_memory_allocated(), 2) if on_cuda else None,
            "output_tokens": produced, "seconds": round(elapsed, 2), "tok_s": round(produced / elapsed, 1),
            "preemptions": llm.engine.stats().num_preemptions}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--serve", type=int, default=0, help="serve this many requests instead")
    parser.add_argument("--device", default="cuda", help="cuda (a CPU only checks that the script runs)")
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs (enforce_eager)")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="schedule and launch step n+1 while the GPU runs step n (engine.py)")
    parser.add_argument("--mixed-graphs", action="store_true",
                        help="steps with prompt chunks through CUDA graphs too (cuda_graphs.py)")
    parser.add_argument("--kv-cache-tokens", type=int, help="KV cache size (default: sized from memory)")
    parser.add_argument("--stub-forward", action="store_true",
                        help="with --eager: no forward at all (zeros), timing the host's share of a step")
    parser.add_argument("--unfused", action="store_true", help="PyTorch's layer ops, not nanoserve/kernels/fused.py")
    parser.add_argument("--profile", action="store_true", help="also the step's GPU time by kernel (torch.profiler)")
    parser.add_argument("--prompt-range", type=int, nargs=2, default=(64, 512), metavar=("LO", "HI"),
                        help="serve: prompt lengths, uniform")
    parser.add_argument("--output-range", type=int, nargs=2, default=(64, 256), metavar=("LO", "HI"),
                        help="serve: output lengths, uniform")
    parser.add_argument("--json")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    result = serve(args) if args.serve else decode(args)
    result["device"] = device_name(args.device)
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
