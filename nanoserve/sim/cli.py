"""`nanoserve simulate POLICY [POLICY ...]`: the real policies and KV managers on a virtual
clock, a named GPU and model priced by the roofline, over one synthetic workload that every
policy sees the same (the README's `simulate(SimConfig(...), trace)`, from the command line).

    nanoserve simulate fcfs conserve --workload sharegpt-ecoserve --rate 8 --requests 2000
    nanoserve simulate ecoserve --gpu A100-80G --model OPT-13B --rate 4 --json ecoserve.json

The papers' own experiments (their workloads, baselines and ratios next to the papers') live
in the source checkout's `experiments/` folder: `python -m experiments kunserve`.
"""
from __future__ import annotations

import argparse

from nanoserve.sched import SCHEDULERS
from nanoserve.sim.hardware import GPUS
from nanoserve.sim.metrics import markdown_table, summarize, to_json
from nanoserve.sim.models import MODELS
from nanoserve.sim.simulation import SimConfig, SimResult, simulate
from nanoserve.sim.workloads import LENGTHS, make_trace, poisson_arrivals


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("policies", nargs="+", metavar="POLICY", choices=sorted(SCHEDULERS),
                        help=f"the scheduling policies to compare: {', '.join(sorted(SCHEDULERS))}")
    parser.add_argument("--workload", default="sharegpt-ecoserve", choices=sorted(LENGTHS),
                        help="the synthetic length distribution (sim/workloads.py; default: sharegpt-ecoserve)")
    parser.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals per second (default: 4)")
    parser.add_argument("--requests", type=int, default=1000, help="requests in the trace (default: 1000)")
    parser.add_argument("--gpu", default=SimConfig.gpu, choices=sorted(GPUS), help=f"default: {SimConfig.gpu}")
    parser.add_argument("--model", default=SimConfig.model, choices=sorted(MODELS),
                        help=f"default: {SimConfig.model}")
    parser.add_argument("--seed", type=int, default=0, help="the trace's seed (default: 0)")
    parser.add_argument("--json", metavar="PATH", help="also write every run, its summaries and counters")


def run(args: argparse.Namespace) -> None:
    lengths = LENGTHS[args.workload]
    trace = make_trace(poisson_arrivals(args.rate, n=args.requests, seed=args.seed), lengths, seed=args.seed)
    results: dict[str, SimResult] = {}
    for policy in dict.fromkeys(args.policies):
        results[policy] = simulate(SimConfig(policy=policy, gpu=args.gpu, model=args.model), trace)
    rows = [(policy, summarize(result)["all"]) for policy, result in results.items()]
    label = f"{lengths.label}, Poisson {args.rate:g} req/s, {args.requests} requests, seed {args.seed}"
    print(f"{args.model} on {args.gpu}\n")
    print(markdown_table(rows, workload=label))
    if args.json:
        to_json(results, args.json, workload=label)
        print(f"wrote {args.json}")
