"""How fast the simulator runs: 10,000 requests through every policy's real scheduler and memory
manager on the virtual clock, on one core. The goal (issue 7): at least 10,000 simulated requests
in 60 s of wall time per policy.

The workload is fixed before any policy runs and is the same for all: ShareGPT-like lengths
(synthetic, EcoServe's statistics) arriving as a Poisson process at `--rate` on Llama-2-7B and
an A100-80G. The peer is the goal itself: the ratio printed is simulated requests per
wall-second over the 167 the goal needs (10,000 / 60).

    python benchmarks/sim_speed.py [--requests 10000] [--rate 8] [--policies fcfs,...]
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one core, as the goal says

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from datetime import date  # noqa: E402

import torch  # noqa: E402

from nanoserve.sched import SCHEDULERS  # noqa: E402
from nanoserve.sim.simulation import SimConfig, simulate  # noqa: E402
from nanoserve.sim.workloads import LENGTHS, make_trace, poisson_arrivals  # noqa: E402

GOAL_REQUESTS_PER_SECOND = 10_000 / 60


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--rate", type=float, default=8.0, help="Poisson arrivals per second")
    parser.add_argument("--policies", default=",".join(SCHEDULERS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    lengths = LENGTHS["sharegpt-ecoserve"]
    trace = make_trace(poisson_arrivals(args.rate, n=args.requests, seed=args.seed), lengths, seed=args.seed)
    print(f"{date.today().isoformat()}; {platform.processor() or platform.machine()}, one thread; "
          f"{args.requests} requests, {lengths.label}, Poisson {args.rate}/s; Llama-2-7B on A100-80G (simulated)")
    print("| policy | wall (s) | simulated requests / wall s | vs goal (167/s) | simulated s | steps |")
    print("|---|---|---|---|---|---|")
    rows = []
    for policy in args.policies.split(","):
        started = time.perf_counter()
        result = simulate(SimConfig(policy=policy), trace)
        wall = time.perf_counter() - started
        rate = args.requests / wall
        rows.append({"policy": policy, "wall_seconds": wall, "requests_per_second": rate,
                     "simulated_seconds": result.duration, "steps": result.steps})
        print(f"| {policy} | {wall:.1f} | {rate:.0f} | {rate / GOAL_REQUESTS_PER_SECOND:.1f}x "
              f"| {result.duration:.0f} | {result.steps} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": date.today().isoformat(), "args": vars(args), "workload": lengths.label,
                       "results": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
