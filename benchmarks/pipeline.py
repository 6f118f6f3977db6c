"""The pipeline bubble, measured: KunServe's lookahead micro-batches against token-count chunking
on a real pipeline-parallel engine (kunserve.txt §4.3, Fig. 8 and 17; the paper reports the
bubble ratio going from 21.9% to 8.3%).

SmolLM2 is split into `--pp` stages (one process each, gloo, one thread per process so the
stages do not fight over the CPU's cores). The queue is KunServe's skewed burst: one long
prompt, whose later chunks attend over a long prefix and cost more than their token count says,
queued with many short prompts. Both runs use the same engine and token budget:

- `fcfs`: the executor cuts each step into `--microbatches` (default 2 per stage) by token count;
- `kunserve`: the scheduler cuts each step along its lookahead micro-batches of equal cost.

Then (unless `--sync-only`; `--async-only` skips the synchronous runs) the same two cuts with
micro-batches kept in flight across steps (`async_pipeline`: each step is one micro-batch, one
per stage in flight, `--depth` to change that), at the
same micro-batch size as the synchronous runs (the budget / the micro-batches per step): token
count gets that as its step budget; the lookahead gets it as MIN (Fig. 11) and twice it as its
budget, so a cheap micro-batch may hold more tokens and a costly one fewer.

Printed: each stage's busy seconds, the span (time with a micro-batch in flight), the bubble
ratio (1 − Σ busy / (stages · span)) and the wall time, and the ratios between the runs; with
`--json`, the same.

With `--sim`, the same comparison on the simulator, at the paper's scale instead of SmolLM2's
on a CPU: Fig. 14's ablation, a burst of 87 LongBench requests (5.9K / 499 tokens) queued at
once on Qwen2.5-14B, served by one two-stage pipeline of two A100-80G (the experiment's
stand-in for the paper's A800-80G). There the two members of the group are vLLM's virtual
engines: each schedules its own step once its previous one has come back, so steps of the
two overlap in the stages (the asynchronous pipeline above). Three cuts of a member's step:
one micro-batch (vLLM's pipeline parallelism), token count with a micro-batch budget of a
quarter of the step's (Sarathi-Serve, Fig. 17 (a)), and KunServe's lookahead into up to 4 of
equal cost and at least MIN tokens, MIN swept (Fig. 11's "profiled off-line" threshold).
Printed: GPU busy seconds, makespan, the bubble ratio (1 − busy / (GPUs · makespan)) and the
mean TPOT, three seeds.

    python benchmarks/pipeline.py [--pp 2] [--long 1536] [--short 24] [--budget 512] [--smoke]
                                  [--sync-only | --async-only] [--sim]
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
from nanoserve.builder import pipeline_microbatches  # noqa: E402
from nanoserve.config import EngineArgs


def workload(args) -> list[list[int]]:
    rng = random.Random(args.seed)
    long = [rng.randrange(17, 40000) for _ in range(args.long)]
    shorts = [[rng.randrange(17, 40000) for _ in range(rng.randint(16, 48))] for _ in range(args.short)]
    return [long] + shorts


def run(policy: str, model: str, prompts: list[list[int]], args, in_flight: bool = False) -> dict:
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    m = pipeline_microbatches(EngineArgs(pipeline_parallel_size=args.pp, pipeline_microbatches=args.microbatches))
    budget, microbatches = args.budget, args.microbatches
    if in_flight:  # the synchronous runs' micro-batch size (see the docstring); one per stage in flight
        budget, microbatches = (args.budget // m) * (2 if policy == "kunserve" else 1), args.depth
    use_min = policy == "kunserve" and args.pipeline_min_tokens
    options = {"pipeline_min_tokens": args.pipeline_min_tokens} if use_min else {}
    with LLM(model, device="cpu", dtype="float32", policy=policy, kv_cache_tokens=args.long * 2 + 4096,
             policy_options=options, max_num_batched_tokens=budget, pipeline_parallel_size=args.pp,
             pipeline_microbatches=microbatches, async_pipeline=in_flight) as llm:
        llm.generate([[100, 200, 300]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        executor = llm.engine.executor
        before = executor.pipeline_stats()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        after = executor.pipeline_stats()
    busy = [b - a for a, b in zip(before["stage_busy_seconds"], after["stage_busy_seconds"])]
    span = after["span_seconds"] - before["span_seconds"]
    return {"policy": policy, "async": in_flight, "budget": budget,
            "depth": after["most_in_flight"] if in_flight else 1, "wall_seconds": wall, "stage_busy_seconds": busy,
            "span_seconds": span, "bubble_ratio": 1.0 - sum(busy) / (len(busy) * span)}


def simulated(seeds: tuple[int, ...] = (0, 1, 2), burst: int = 87) -> list[dict]:
    """Fig. 14's burst on a simulated two-stage group, three cuts of a step (see the docstring)."""
    from experiments.kunserve import GPU, MODEL
    from nanoserve.sim.cluster import ClusterConfig, simulate_cluster
    from nanoserve.sim.cluster_layout import member_microbatches
    from nanoserve.sim.simulation import SimConfig
    from nanoserve.sim.workloads import LENGTHS, make_trace

    min_default = SimConfig().max_num_batched_tokens // member_microbatches(2)
    cuts = {"one per step (vLLM PP)": ("fcfs", False, None),
            f"token count (<= {min_default} tokens)": ("fcfs", True, None),
            f"lookahead (MIN {min_default}, default)": ("kunserve", False, None),
            "lookahead (MIN 128)": ("kunserve", False, 128),
            "lookahead (MIN 1: always 4)": ("kunserve", False, 1)}
    rows = []
    for seed in seeds:
        trace = make_trace([0.0] * burst, LENGTHS["longbench"], seed=seed)
        for label, (policy, token_count, min_tokens) in cuts.items():
            options = {} if min_tokens is None else {"pipeline_min_tokens": min_tokens}
            config = ClusterConfig(SimConfig(policy=policy, gpu=GPU, model=MODEL, policy_options=options),
                                   num_instances=2, static_pipeline_stages=2, token_count_cut=token_count)
            result = simulate_cluster(config, trace)
            tpots = [r.tpot for r in result.records if r.tpot is not None]
            rows.append({"seed": seed, "cut": label, "busy_seconds": result.busy_seconds,
                         "makespan": result.duration, "unfinished": result.unfinished,
                         "bubble_ratio": 1.0 - result.busy_seconds / (2 * result.duration),
                         "mean_tpot": sum(tpots) / len(tpots)})
    print(f"simulated: {burst} LongBench requests at once, {MODEL} on a two-stage group of {GPU}")
    print("| seed | micro-batches | GPU busy (s) | makespan (s) | bubble ratio | mean TPOT (ms) | unfinished |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['seed']} | {r['cut']} | {r['busy_seconds']:.1f} | {r['makespan']:.1f} | {r['bubble_ratio']:.1%} "
              f"| {r['mean_tpot'] * 1e3:.1f} | {r['unfinished']} |")
    for label in cuts:
        mine = [r["bubble_ratio"] for r in rows if r["cut"] == label]
        print(f"{label}: bubble ratio {min(mine):.1%}-{max(mine):.1%} over seeds {list(seeds)}")
    return rows


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
    parser.add_argument("--sync-only", action="store_true", help="only synchronous steps")
    parser.add_argument("--async-only", action="store_true", help="only micro-batches in flight")
    parser.add_argument("--depth", type=int, default=None,
                        help="micro-batches in flight for the in-flight runs (default: one per stage)")
    parser.add_argument("--pipeline-min-tokens", type=int, default=None,
                        help="kunserve's MIN for a synchronous step's cut "
                             "(default: budget / micro-batches; 1: always cut)")
    parser.add_argument("--sim", action="store_true", help="the simulated comparison at the paper's scale instead")
    parser.add_argument("--smoke", action="store_true", help="a tiny run: a 96-token prompt and 4 short ones")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    if args.smoke:
        args.long, args.short, args.budget, args.max_tokens = 96, 4, 64, 2
    if args.sim:
        rows = simulated()
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"date": date.today().isoformat(), "simulated": rows}, f, indent=2)
        return 0
    model = args.model or default_model()
    prompts = workload(args)
    modes = [m for m, skip in ((False, args.async_only), (True, args.sync_only)) if not skip]
    results = [run(policy, model, prompts, args, in_flight) for in_flight in modes for policy in ("fcfs", "kunserve")]
    m = pipeline_microbatches(EngineArgs(pipeline_parallel_size=args.pp, pipeline_microbatches=args.microbatches))
    print(f"{date.today().isoformat()}; {platform.processor() or platform.machine()}; SmolLM2 fp32, {args.pp} stages "
          f"(gloo, 1 thread each); a {args.long}-token prompt and {args.short} short ones; synchronous: budget "
          f"{args.budget} in {m} micro-batches per step; in flight: {args.pp} micro-batches of "
          f"~{args.budget // m} tokens")
    print("| steps | micro-batches | budget | stage busy (s) | span (s) | bubble ratio | wall (s) |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        busy = ", ".join(f"{b:.2f}" for b in r["stage_busy_seconds"])
        label = "token count (fcfs)" if r["policy"] == "fcfs" else "lookahead (kunserve)"
        print(f"| {'in flight' if r['async'] else 'synchronous'} | {label} | {r['budget']} | {busy} | "
              f"{r['span_seconds']:.2f} | {r['bubble_ratio']:.1%} | {r['wall_seconds']:.2f} |")
    for i in range(0, len(results), 2):
        base, mine = results[i], results[i + 1]
        print(f"{'in flight' if base['async'] else 'synchronous'}: bubble ratio lookahead / token count "
              f"{mine['bubble_ratio'] / base['bubble_ratio']:.2f}x; "
              f"wall time {mine['wall_seconds'] / base['wall_seconds']:.2f}x")
    if len(modes) == 2:
        for k, policy in enumerate(("fcfs", "kunserve")):
            sync, flight = results[k], results[2 + k]
            print(f"{policy}: in flight / synchronous: "
                  f"bubble ratio {flight['bubble_ratio'] / sync['bubble_ratio']:.2f}x, "
                  f"wall time {flight['wall_seconds'] / sync['wall_seconds']:.2f}x")
    floor = (args.pp - 1) / (m + args.pp - 1)
    print(f"the fill-and-drain floor of a synchronous step with {m} equal micro-batches: {floor:.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": date.today().isoformat(), "args": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
