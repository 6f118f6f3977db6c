"""KunServe's cluster on a CPU (kunserve.txt §3, §4; Fig. 12-13 and 17 in miniature): a burst into
two SmolLM2 instances whose KV pools it overflows, served once with parameter dropping and once
without (vLLM's answer: the queue waits, and running requests that cannot grow are preempted
and recomputed). Both runs use the same fcfs policy, pools and burst; unless --smoke, a last
drop run uses the kunserve policy (§4.3's lookahead micro-batches through the group), and two
more runs (with and without the drop) step each group on its own (`Cluster(stepping="group_lockstep")`,
an asynchronous front) where the others step the whole cluster in lockstep, and two drop runs (one
per front) keep each group's steps in flight (`async_pipeline`: each stage on a different step).

Printed, each as ours next to its reference:
- KV capacity after the drop against the theoretical gain: a member keeps its stage's layers,
  so a block holds fewer layers, and the dropped layers' weight bytes become KV;
- the time from throttling detected to the first queued request's first token, with the drop
  (drop + remap + KV exchange, then the step) and without it (waiting for memory to free);
  the drop's own time (the paper: about 5 ms with CUDA virtual memory on a GPU);
- the restore's stop, with the weights pulled while the pipeline serves (§4.4's overlap, the
  default) and, unless --smoke, in a third run that loads them at the switch (waiting);
- TTFT p50 / p99 of the burst, with and without the drop;
- the pipeline bubble with lookahead micro-batches against token-count chunking
  (benchmarks/pipeline.py's run; the paper: 21.9% -> 8.3%).

    python benchmarks/cluster.py [--requests 24] [--prompt 96-192] [--kv-tokens 1024] [--tail 2] [--smoke]
                                 [--instances 2] [--no-lookahead]

`--tail N` adds N requests that decode `--tail-tokens` tokens, so the cluster is still serving
when the burst has passed and the restore is due (without them it restores in the last step).
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads; the instances inherit it

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
from datetime import date  # noqa: E402

from nanoserve import SamplingParams, default_model  # noqa: E402
from nanoserve.cluster.cluster import Cluster  # noqa: E402
from nanoserve.config import EngineArgs  # noqa: E402
from nanoserve.slo import percentile  # noqa: E402


def burst(args) -> list[list[int]]:
    rng = random.Random(args.seed)
    lo, hi = map(int, args.prompt.split("-"))
    return [[rng.randrange(17, 40000) for _ in range(rng.randint(lo, hi))] for _ in range(args.requests + args.tail)]


def run(drop: bool, model: str, prompts: list[list[int]], args, background_restore: bool = True,
        policy: str = "fcfs", stepping: str = "lockstep", async_pipeline: bool = False) -> dict:
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    tail = SamplingParams(temperature=0, max_tokens=args.tail_tokens, ignore_eos=True)
    engine_args = EngineArgs(model=model, device="cpu", dtype="float32", kv_cache_tokens=args.kv_tokens,
                             max_num_batched_tokens=args.budget, policy=policy, async_pipeline=async_pipeline)
    with Cluster(engine_args, args.instances, drop=drop, background_restore=background_restore,
                 stepping=stepping) as cluster:
        cluster.generate([[100, 200, 300]], SamplingParams(max_tokens=2))  # warm-up
        begun = time.perf_counter()
        ids = [f"burst-{i}" for i in range(len(prompts))]
        for k, (request_id, prompt) in enumerate(zip(ids, prompts)):
            cluster.add_request(request_id, prompt, params if k < args.requests else tail)
        first_token: dict[str, float] = {}
        finished: dict = {}
        detected = None
        while len(finished) < len(ids):
            outputs = cluster.step()
            now = time.perf_counter()
            for out in outputs:
                first_token.setdefault(out.request_id, now)
                if out.finished:
                    finished[out.request_id] = out
            if detected is None and cluster.throttle_events:
                detected, queued = now, [i for i in ids if i not in first_token]
        wall_s = time.perf_counter() - begun
        changes = cluster.layout_changes
        regrouper = cluster.regrouper
        pulls = cluster.restore_pulls
        steps_sent = sum(cluster.steps_sent.values())
        changes_beside_steps = cluster.changes_beside_steps
        drains = cluster.drains
    ttfts = [finished[i].metrics.ttft for i in ids]
    output_tokens = sum(len(finished[i].token_ids) for i in ids)
    result = {"drop": drop, "stepping": stepping, "ttft_p50": percentile(ttfts, 50), "ttft_p99": percentile(ttfts, 99),
              "wall_s": wall_s, "output_tok_s": output_tokens / wall_s, "steps_sent": steps_sent,
              "changes_beside_steps": changes_beside_steps, "drains": drains,
              "preemptions": sum(finished[i].metrics.num_preemptions for i in ids),
              "detect_to_queued_first_token": (min(first_token[i] for i in queued) - detected) if detected else None,
              "changes": [(c.kind, c.seconds, c.kv_bytes_sent, c.capacity_before, c.capacity_after) for c in changes]}
    drops = [c for c in changes if c.kind == "drop"]
    if drops:
        merged = [g for g in drops[0].after if g.size > 1]
        replica_blocks = drops[0].capacity_before // sum(g.size for g in merged)
        result["theory_gain"] = theoretical_gain(regrouper.layer_bytes, regrouper.block_bytes, replica_blocks, merged)
        result["measured_gain"] = drops[0].capacity_after / drops[0].capacity_before
        result["drop_seconds"] = drops[0].seconds
        result["drop_kv_bytes_sent"] = drops[0].kv_bytes_sent
        result["exchange_steps"] = drops[0].exchange_steps
    restores = [c for c in changes if c.kind == "restore"]
    if restores:
        result["restore_seconds"] = restores[0].seconds
        result["restore_weights_copied"] = restores[0].weights_copied
    switched = [p for p in pulls if p["outcome"] == "switched"]
    if switched:
        result["pull"] = switched[0]
    result["pulls_cancelled"] = sum(p["outcome"] == "cancelled" for p in pulls)
    return result


def theoretical_gain(layer_bytes, block_bytes: int, replica_blocks: int, groups) -> float:
    """Pools after / before for the merged members: a member's KV bytes plus the bytes of the
    layers it drops, over a block of its stage's layers only; a group's pool is its smallest
    member's (every member keeps every request's blocks for its layers)."""
    before = after = 0
    for group in groups:
        num_layers = len(layer_bytes)
        kv_bytes = replica_blocks * block_bytes
        per_member = [(kv_bytes + sum(layer_bytes) - sum(layer_bytes[i] for i in stage))
                      // (block_bytes * len(stage) // num_layers) for stage in group.stages]
        before += replica_blocks * group.size
        after += min(per_member)
    return after / before


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--prompt", default="96-192", help="prompt length range")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--tail", type=int, default=0, help="requests that decode on after the burst")
    parser.add_argument("--tail-tokens", type=int, default=256)
    parser.add_argument("--kv-tokens", type=int, default=1024, help="each instance's KV pool")
    parser.add_argument("--budget", type=int, default=1024, help="max_num_batched_tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--no-lookahead", action="store_true", help="skip the kunserve-policy run")
    parser.add_argument("--no-pipeline", action="store_true", help="skip the bubble comparison")
    parser.add_argument("--smoke", action="store_true", help="a tiny run")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    if args.smoke:
        args.requests, args.prompt, args.max_tokens, args.kv_tokens, args.no_pipeline = 6, "40-60", 3, 128, True
    model = args.model or default_model()
    prompts = burst(args)
    base, mine = run(False, model, prompts, args), run(True, model, prompts, args)
    waiting = None if args.smoke else run(True, model, prompts, args, background_restore=False)
    # Fig. 14's lookahead in the real cluster: the kunserve policy cuts a grouped member's step
    # into cost-balanced micro-batches over its queue, which the group executor pipelines.
    lookahead = None if args.smoke or args.no_lookahead else run(True, model, prompts, args, policy="kunserve")
    # Issue 46 item 5: each group on its own (an asynchronous front) against the lockstep above.
    base_async = None if args.smoke else run(False, model, prompts, args, stepping="group_lockstep")
    mine_async = None if args.smoke else run(True, model, prompts, args, stepping="group_lockstep")
    # ...and the groups keeping their steps in flight (each stage on a different step), both fronts.
    in_flight = None if args.smoke else run(True, model, prompts, args, async_pipeline=True)
    in_flight_async = None if args.smoke else run(True, model, prompts, args, stepping="group_lockstep",
                                                  async_pipeline=True)
    print(f"{date.today().isoformat()}; {platform.processor() or platform.machine()}; {os.path.basename(model)} fp32, "
          f"{args.instances} instances (1 thread each); a burst of {args.requests} prompts of {args.prompt} tokens, "
          f"{args.max_tokens} output tokens" + (f", and {args.tail} decoding {args.tail_tokens}" if args.tail else "")
          + f"; {args.kv_tokens}-token KV pool per instance")
    if "measured_gain" in mine:
        print(f"KV capacity after the drop: {mine['measured_gain']:.2f}x; theory {mine['theory_gain']:.2f}x "
              f"(measured / theory {mine['measured_gain'] / mine['theory_gain']:.3f})")
        print(f"drop + remap: {mine['drop_seconds'] * 1e3:.1f} ms; then the KV exchange, "
              f"{mine['drop_kv_bytes_sent'] / 2**20:.1f} MiB in {mine['exchange_steps']} steps (a chunk per step)")
    for r, label in ((mine, "weights pulled in the background"), (waiting, "weights loaded at the switch")):
        if r is not None and "restore_seconds" in r:
            pull = r.get("pull")
            print(f"restore stop, {label}: {r['restore_seconds'] * 1e3:.1f} ms, "
                  f"{r['restore_weights_copied'] / 2**20:.1f} MiB of weights copied in it"
                  + (f"; {pull['pulled_bytes'] / 2**20:.1f} MiB pulled over {pull['steps']} steps before"
                     if pull else "") + " (the KV then comes home a chunk per step)")
    print("| cluster | throttle detected -> a queued request's first token (s) | TTFT p50 (s) | TTFT p99 (s) "
          "| preemptions | wall (s) | output tok/s | steps sent |")
    print("|---|---|---|---|---|---|---|---|")
    rows = ((base, "no drop (recompute)"), (mine, "KunServe drop"), (waiting, "KunServe drop, waiting restore"),
            (lookahead, "KunServe drop + lookahead micro-batches (kunserve policy)"),
            (base_async, "no drop, each instance on its own (group_lockstep)"),
            (mine_async, "KunServe drop, each group on its own (group_lockstep)"),
            (in_flight, "KunServe drop, steps in flight in the groups (async_pipeline)"),
            (in_flight_async, "KunServe drop, steps in flight, each group on its own"))
    for r, label in [(r, label) for r, label in rows if r is not None]:
        wait = r["detect_to_queued_first_token"]
        print(f"| {label} | {'-' if wait is None else f'{wait:.2f}'} | {r['ttft_p50']:.2f} | {r['ttft_p99']:.2f} "
              f"| {r['preemptions']} | {r['wall_s']:.1f} | {r['output_tok_s']:.1f} | {r['steps_sent']} |")
    if mine_async is not None:
        print(f"asynchronous front / lockstep, with the drop: TTFT p99 "
              f"{mine_async['ttft_p99'] / mine['ttft_p99']:.2f}x, "
              f"output tok/s {mine_async['output_tok_s'] / mine['output_tok_s']:.2f}x")
    for r, label in ((in_flight, "lockstep front"), (in_flight_async, "group_lockstep front")):
        if r is not None:
            reference = mine if r is in_flight else mine_async
            assert reference is not None
            print(f"steps in flight / synchronous groups, with the drop, {label}: TTFT p99 "
                  f"{r['ttft_p99'] / reference['ttft_p99']:.2f}x, output tok/s "
                  f"{r['output_tok_s'] / reference['output_tok_s']:.2f}x ({r['drains']} drains)")
    if base["detect_to_queued_first_token"] and mine["detect_to_queued_first_token"]:
        print(f"queued request's wait, no drop / drop: "
              f"{base['detect_to_queued_first_token'] / mine['detect_to_queued_first_token']:.2f}x; "
              f"TTFT p99 no drop / drop: {base['ttft_p99'] / mine['ttft_p99']:.2f}x")
    results = {"date": date.today().isoformat(), "args": vars(args), "no_drop": base, "drop": mine,
               "drop_waiting_restore": waiting, "drop_lookahead": lookahead, "no_drop_group_lockstep": base_async,
               "drop_group_lockstep": mine_async, "drop_in_flight": in_flight,
               "drop_in_flight_group_lockstep": in_flight_async}
    if not args.no_pipeline:
        import pipeline  # benchmarks/pipeline.py, beside this file

        pp = argparse.Namespace(pp=2, long=1536, short=24, budget=512, max_tokens=4, microbatches=None, seed=args.seed)
        pp_prompts = pipeline.workload(pp)
        runs = [pipeline.run(policy, model, pp_prompts, pp) for policy in ("fcfs", "kunserve")]
        print(f"pipeline bubble (2 stages): token count {runs[0]['bubble_ratio']:.1%}, lookahead "
              f"{runs[1]['bubble_ratio']:.1%} ({runs[1]['bubble_ratio'] / runs[0]['bubble_ratio']:.2f}x); the paper: "
              f"21.9% -> 8.3%")
        results["pipeline"] = runs
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
