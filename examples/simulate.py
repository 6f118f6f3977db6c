"""Re-run a paper's headline comparison in the simulator: the real policies and KV managers on a
virtual clock, a named GPU and model priced by a roofline, a synthetic workload fixed up front.

    python examples/simulate.py kunserve                 # KunServe vs vLLM and vLLM-PP (8 x A100)
    python examples/simulate.py ecoserve --plot plots/   # EcoServe vs vLLM (2023), FastGen-like, ORCA
    python examples/simulate.py bros                     # BROS vs vLLM (2023) and round-robin
    python examples/simulate.py conserve                 # ConServe vs Online-Only and vLLM++ (swap)
    python examples/simulate.py all                      # every policy on one mixed workload
    python examples/simulate.py ecoserve --scale ci      # the few-hundred-request version CI runs
    python examples/simulate.py conserve --no-calibration   # ablation: policies keep their fitted profile

It prints a table per run, then our ratio next to the paper's claim, and notes on any gap.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from nanoserve.sim.experiments import EXPERIMENTS, SCALES, run_experiment
from nanoserve.sim.experiments.report import format_report, save_json, save_plots


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("experiment", choices=list(EXPERIMENTS))
    parser.add_argument("--scale", choices=SCALES, default="paper",
                        help="paper: the paper's setup; ci: a few hundred requests (default: paper)")
    parser.add_argument("--seed", type=int, default=0, help="the workload's seed (default 0)")
    parser.add_argument("--json", metavar="PATH", help="write every run, its summaries and the comparisons")
    parser.add_argument("--plot", metavar="DIR", help="write PNG plots (needs matplotlib: pip install '.[bench]')")
    parser.add_argument("--no-calibration", action="store_true",
                        help="do not calibrate the policies' cost model on the simulated steps (as the real engine "
                             "does by default): an ablation")
    args = parser.parse_args(argv)
    if args.no_calibration:
        os.environ["NANOSERVE_SIM_CALIBRATE"] = "0"  # read by every SimConfig the experiment builds
    started = time.perf_counter()
    result = run_experiment(args.experiment, args.scale, args.seed)
    print(format_report(result))
    if args.json:
        save_json(result, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        for path in save_plots(result, args.plot):
            print(f"wrote {path}")
    print(f"({time.perf_counter() - started:.0f} s wall)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
