"""`python -m experiments EXPERIMENT`: re-run a paper's headline comparison in the simulator: the real
policies and KV managers on a virtual clock, a named GPU and model priced by a roofline, a synthetic
workload fixed up front.

    python -m experiments kunserve                 # KunServe vs vLLM and vLLM-PP (8 x A100)
    python -m experiments ecoserve --plot plots/   # EcoServe vs vLLM (2023), FastGen-like, ORCA
    python -m experiments bros                     # BROS vs vLLM (2023) and round-robin
    python -m experiments conserve                 # ConServe vs Online-Only and vLLM++ (swap)
    python -m experiments all                      # every policy on one mixed workload
    python -m experiments ecoserve --scale ci      # the few-hundred-request version CI runs
    python -m experiments conserve --no-calibration   # ablation: policies keep their fitted profile
    python -m experiments bros --seed 0 1 2        # three seeds, then each ratio's mean and range
    python -m experiments ecoserve --datasets bookcorpus --seed 1 --points bc.jsonl   # resumable
    python -m experiments ecoserve --datasets alpaca --requests 2000 --no-ablation   # smaller, no Fig. 11
    python -m experiments bros --panels b --seed 1 --points bros-b.jsonl   # one panel of Fig. 10, resumable
    NANOSERVE_PROGRESS=1 nohup python -m experiments ecoserve > log &   # progress in the log too

It prints a table per run, then our ratio next to the paper's claim, and notes on any gap.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import experiments
from experiments import EXPERIMENTS, EXTRA_SCALES, SCALES
from experiments.report import format_report, save_json, save_plots, seeds_table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("experiment", choices=list(EXPERIMENTS))
    parser.add_argument("--scale", choices=(*SCALES, *EXTRA_SCALES), default="paper",
                        help="paper: the paper's setup; ci: a few hundred requests; long: kunserve's 640 s "
                             "BurstGPT run (Fig. 15) (default: paper)")
    parser.add_argument("--seed", type=int, nargs="+", default=[0],
                        help="the workload's seed, or several: each runs, then a table of every ratio over them "
                             "(default 0)")
    parser.add_argument("--json", metavar="PATH", help="write every run, its summaries and the comparisons "
                                                       "(several seeds: PATH with -seedN before its suffix)")
    parser.add_argument("--plot", metavar="DIR", help="write PNG plots (needs matplotlib: pip install '.[bench]'); "
                                                      "several seeds: the first seed's")
    parser.add_argument("--no-calibration", action="store_true",
                        help="do not calibrate the policies' cost model on the simulated steps (as the real engine "
                             "does by default): an ablation")
    parser.add_argument("--datasets", nargs="+", metavar="NAME",
                        help="ecoserve only: the traces to sweep (sharegpt, alpaca, bookcorpus; default: all three)")
    parser.add_argument("--requests", type=int, metavar="N",
                        help="ecoserve only: requests per rate (default: 10,000 at paper scale, 150 at ci)")
    parser.add_argument("--no-ablation", action="store_true",
                        help="ecoserve: skip Fig. 11's ablation at each trace's table rate; bros: skip §4.2's")
    parser.add_argument("--points", metavar="FILE",
                        help="ecoserve, bros and conserve: a JSON-lines file of finished runs, read and appended "
                             "to as each finishes, so that a stopped sweep resumes (with several seeds: FILE with "
                             "-seedN before its suffix)")
    parser.add_argument("--panels", nargs="+", metavar="PANEL", choices=("a", "b", "c"),
                        help="bros only: Fig. 10's panels to run (a, b, c; default: all three at paper scale)")
    args = parser.parse_args(argv)
    if (args.datasets or args.requests) and args.experiment != "ecoserve":
        parser.error("--datasets and --requests are for the ecoserve experiment")
    if args.points and args.experiment not in ("ecoserve", "bros", "conserve"):
        parser.error("--points is for the ecoserve, bros and conserve experiments")
    if args.no_ablation and args.experiment not in ("ecoserve", "bros"):
        parser.error("--no-ablation is for the ecoserve and bros experiments")
    if args.panels and args.experiment != "bros":
        parser.error("--panels is for the bros experiment")
    if args.no_calibration:
        os.environ["NANOSERVE_SIM_CALIBRATE"] = "0"  # read by every SimConfig the experiment builds
    started = time.perf_counter()
    results = {}
    for seed in dict.fromkeys(args.seed):
        options: dict[str, object] = {"datasets": args.datasets} if args.datasets else {}
        if args.requests:
            options["requests"] = args.requests
        if args.no_ablation:
            options["ablation"] = False
        if args.panels:
            options["panels"] = args.panels
        if args.points:
            points = Path(args.points)
            options["points"] = (points if len(args.seed) == 1
                                 else points.with_name(f"{points.stem}-seed{seed}{points.suffix}"))
        # Looked up on the package at each call, so a test may stand in for it.
        results[seed] = result = experiments.run_experiment(args.experiment, args.scale, seed, **options)
        if len(args.seed) > 1:
            print(f"# seed {seed}\n")
        print(format_report(result))
        if args.json:
            path = Path(args.json)
            path = path if len(args.seed) == 1 else path.with_name(f"{path.stem}-seed{seed}{path.suffix}")
            save_json(result, path)
            print(f"wrote {path}")
        if args.plot and seed == args.seed[0]:
            for plot_path in save_plots(result, args.plot):
                print(f"wrote {plot_path}")
    if len(results) > 1:
        print(f"# every ratio over seeds {', '.join(map(str, results))}\n")
        print(seeds_table(results))
    print(f"({time.perf_counter() - started:.0f} s wall)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
