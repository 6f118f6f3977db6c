"""Profile the real model runner and fit the iteration cost model (`nanoserve.sched.cost_model`).

    nanoserve profile [MODEL] [--device cuda] [--dtype bf16] [--out cost.json] [--quick]

Following BROS §4.1 ("Inference cost modeling"), we time dummy batches offline, with lengths on
a grid of powers of two, and fit a linear model; the model's terms are KunServe's Eq. (1) for
prefill chunks plus separate decode terms. The grid covers each term's own axis, so the fit can
tell them apart: prefill chunks of several sizes, with and without a cached prefix (α vs. β),
one to several chunks per batch (γ vs. the iteration constant), decode batches of several sizes
and context lengths (δ vs. ε), and prefill mixed with decodes (the terms add up).

The batches run through `executor.execute(SchedulerOutput(...))`, the engine's own path
(input preparation, forward, logits, sampling). Their KV blocks come from a private `BlockPool`
sized to the runner's cache and are freed after each sample; the K/V they attend over is
whatever the cache holds, which changes the values but not the time.
"""
from __future__ import annotations

import argparse
import time
from itertools import count
from pathlib import Path

import torch

from nanoserve.builder import build_engine_and_runner
from nanoserve.config import EngineArgs
from nanoserve.device import resolve_device, resolve_dtype
from nanoserve.engine_flags import add_engine_arguments, engine_args_from
from nanoserve.memory.blocks import BlockPool
from nanoserve.model.runner import ModelRunner
from nanoserve.request import Request
from nanoserve.sampling import SamplingParams
from nanoserve.sched import POLICY_MEMORY
from nanoserve.sched.cost_model import Batch, CostModel, FitReport, Sample, evaluate, fit
from nanoserve.sched.output import ScheduledChunk, SchedulerOutput
from nanoserve.sched.profile_grid import FULL, QUICK, Grid, synthetic_batches


class Profiler:
    """Times synthetic batches on one runner."""

    def __init__(self, runner: ModelRunner, vocab_size: int, seed: int = 0):
        self.runner = runner
        first = runner.kv_caches[0]
        assert first is not None, "the profiled runner holds every layer"
        num_blocks, block_size = first[0].shape[:2]
        # Private: the engine's own manager (whatever it is) never sees these sequences.
        self.pool = BlockPool(num_blocks, block_size)
        self.vocab_size = vocab_size
        self.rng = torch.Generator().manual_seed(seed)
        self.ids = count()
        self.params = SamplingParams(max_tokens=1, temperature=0.0)

    def _build(self, batch: Batch) -> SchedulerOutput:
        chunks = []
        for prefix_len, num_new in batch:
            tokens = torch.randint(self.vocab_size, (prefix_len + num_new,), generator=self.rng).tolist()
            request = Request(f"profile-{next(self.ids)}", tokens, self.params)
            self.pool.allocate(request.request_id, prefix_len + num_new)
            chunks.append(ScheduledChunk(request, prefix_len, num_new, self.pool.block_table(request.request_id)))
        return SchedulerOutput(chunks)

    def _sync(self) -> None:
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)

    def time_once(self, batch: Batch) -> float:
        """Seconds of one execution of `batch` (its KV blocks are freed afterwards)."""
        output = self._build(batch)
        try:
            self._sync()  # nothing queued from before may count against this batch
            start = time.perf_counter()
            self.runner.execute(output)
            self._sync()
            return time.perf_counter() - start
        finally:
            for chunk in output.chunks:
                self.pool.free(chunk.request.request_id)

    def run(self, batches: list[tuple[tuple[int, int], ...]], repeats: int, verbose: bool = False) -> list[Sample]:
        """The fastest of `repeats` timings per batch. Rounds go over the whole grid (round 0 a
        discarded warm-up: allocator growth, kernel autotuning), so that a burst of outside load
        spoils one timing of several batches rather than every timing of one. The minimum, not
        the mean: outside load only ever adds time (timeit's advice), and the model should
        describe the batch, not the neighbours."""
        times: list[list[float]] = [[] for _ in batches]
        for round_ in range(repeats + 1):
            for i, batch in enumerate(batches):
                seconds = self.time_once(batch)
                if round_:
                    times[i].append(seconds)
        samples = [Sample(batch, min(t)) for batch, t in zip(batches, times)]
        if verbose:
            for i, sample in enumerate(samples):
                print(f"[{i + 1}/{len(samples)}] {describe(sample.batch)}: {sample.seconds * 1e3:.2f} ms")
        return samples


def describe(batch: Batch) -> str:
    prefill = [(p, c) for p, c in batch if c > 1]
    decodes = [p + 1 for p, c in batch if c == 1]
    parts = ([f"prefill {c}@{p}" for p, c in prefill[:2]]
             + ([f"... ({len(prefill)} chunks)"] if len(prefill) > 2 else []))
    if decodes:
        parts.append(f"{len(decodes)} decodes, ctx {max(decodes)}")
    return ", ".join(parts)


def profile(args: EngineArgs, grid: Grid, verbose: bool = False) -> tuple[CostModel, FitReport, list[Sample]]:
    """Build the engine's runner, time the grid's batches on it and fit the cost model."""
    if (args.kv_manager or POLICY_MEMORY[args.policy]) != "paged":
        raise ValueError("profile with the 'paged' KV manager: the runner must own a plain KV cache")
    if args.tensor_parallel_size * args.pipeline_parallel_size > 1:
        raise ValueError("the profiler times one device's runner: no tensor or pipeline parallelism")
    engine, runner = build_engine_and_runner(args)
    profiler = Profiler(runner, runner.model_config.vocab_size, args.seed)
    batches = synthetic_batches(grid, engine.config.max_model_len, profiler.pool.num_blocks, profiler.pool.block_size)
    samples = profiler.run(batches, grid.repeats, verbose)
    model = fit(samples)
    return model, evaluate(model, samples), samples


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`nanoserve profile`'s flags: the output, the grid, and the engine's (engine_flags.py)."""
    parser.add_argument("--out", default="cost.json", type=Path, help="the fitted model's JSON (default: cost.json)")
    parser.add_argument("--quick", action="store_true", help="a small grid (seconds on a CPU)")
    parser.add_argument("--verbose", "-v", action="store_true")
    add_engine_arguments(parser)


def run(opts: argparse.Namespace) -> None:
    args = engine_args_from(opts)
    grid = QUICK if opts.quick else FULL
    model, report, samples = profile(args, grid, opts.verbose)
    device = resolve_device(args.device)
    meta = {"model": args.model or "SmolLM2 (embedded)", "device": str(device),
            "dtype": str(resolve_dtype(args.dtype, device)), "quick": opts.quick}
    model.save(opts.out, fit=report.to_dict(), samples=[s.to_dict() for s in samples], meta=meta)
    print("coefficients: " + ", ".join(f"{k}={v:.3e}" for k, v in model.to_dict().items()))
    print(f"fit: {report}")
    print(f"wrote {opts.out}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
