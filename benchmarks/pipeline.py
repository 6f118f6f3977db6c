"""The pipeline bubble, measured: KunServe's lookahead micro-batches against token-count chunking
on a real pipeline-parallel engine (kunserve.txt §4.3, Fig. 8 and 17; the paper reports the
bubble ratio going from 21.9% to 8.3%).

SmolLM2 is split into `--pp` stages (one process each, gloo, one thread per process so the
stages do not fight over the CPU's cores). The queue is KunServe's skewed burst: one long
prompt, whose later chunks attend over a long prefix and cost more than their token count says,
queued with many short prompts. Both runs use the same engine and token budget:

- `fcfs`: the executor cuts each step into `--microbatches` (default 2 per stage) by token count;
- `kunserve`: the scheduler cuts each step along its lookahead micro-batches of equal cost.

Printed: each stage's busy seconds, the step span, the bubble ratio (1 − Σ busy / (stages ·
span)) and the wall time, and the ratio between the two policies; with `--json`, the same.

    python benchmarks/pipeline.py [--pp 2] [--long 1536] [--short 24] [--budget 512] [--smoke]
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads; the workers inherit it

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
from datetime import date  # noqa: E402

from nanoserve import LLM, SamplingParams, default_model  # noqa: E402
from nanoserve.builder import EngineArgs, pipeline_microbatches  # noqa: E402


def workload(args) -> list[list[int]]:
    rng = random.Random(args.seed)
    long = [rng.randrange(17, 40000) for _ in range(args.long)]
    shorts = [[rng.randrange(17, 40000) for _ in range(rng.randint(16, 48))] for _ in range(args.short)]
    return [long] + shorts


def run(policy: str, model: str, prompts: list[list[int]], args) -> dict:
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    with LLM(model, device="cpu", dtype="float32", policy=policy, kv_cache_tokens=args.long * 2 + 4096,
             max_num_batched_tokens=args.budget, pipeline_parallel_size=args.pp,
             pipeline_microbatches=args.microbatches) as llm:
        llm.generate([[100, 200, 300]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        executor = llm.engine.executor
        before = executor.pipeline_stats()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        after = executor.pipeline_stats()
    busy = [b - a for a, b in zip(before["stage_busy_seconds"], after["stage_busy_seconds"])]
    span = after["span_seconds"] - before["span_seconds"]
    return {"policy": policy, "wall_seconds": wall, "stage_busy_seconds": busy, "span_seconds": span,
            "bubble_ratio": 1.0 - sum(busy) / (len(busy) * span)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--long", type=int, default=1536, help="tokens of the long prompt")
    parser.add_argument("--short", type=int, default=24, help="short prompts (16-48 tokens) queued with it")
    parser.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=None, help="per step (default: 2 per stage)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="a tiny run: a 96-token prompt and 4 short ones")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    if args.smoke:
        args.long, args.short, args.budget, args.max_tokens = 96, 4, 64, 2
    model = args.model or default_model()
    prompts = workload(args)
    results = [run(policy, model, prompts, args) for policy in ("fcfs", "kunserve")]
    m = pipeline_microbatches(EngineArgs(pipeline_parallel_size=args.pp, pipeline_microbatches=args.microbatches))
    print(f"{date.today().isoformat()}; {platform.processor() or platform.machine()}; SmolLM2 fp32, {args.pp} stages "
          f"(gloo, 1 thread each), {m} micro-batches per step; a {args.long}-token "
          f"prompt and {args.short} short ones; budget {args.budget}")
    print("| micro-batches | stage busy (s) | span (s) | bubble ratio | wall (s) |")
    print("|---|---|---|---|---|")
    for r, label in zip(results, ("token count (fcfs)", "lookahead (kunserve)")):
        busy = ", ".join(f"{b:.2f}" for b in r["stage_busy_seconds"])
        print(f"| {label} | {busy} | {r['span_seconds']:.2f} | {r['bubble_ratio']:.1%} | {r['wall_seconds']:.2f} |")
    base, mine = results
    print(f"bubble ratio lookahead / token count: {mine['bubble_ratio'] / base['bubble_ratio']:.2f}x; "
          f"wall time: {mine['wall_seconds'] / base['wall_seconds']:.2f}x; the fill-and-drain floor of a "
          f"step with {m} equal micro-batches: {(args.pp - 1) / (m + args.pp - 1):.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": date.today().isoformat(), "args": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
