"""Diagnostic for RESULTS.md (issue 45, ConServe): Fig. 8's four bars, seeds 0-2, at the paper's constant SLOs
(1,500 / 110 ms) instead of the derived ones. Run from the checkout root:
PYTHONPATH=. python benchmarks/results/conserve/diag_fig8_paper_slo.py"""
import json

from experiments import conserve as c
from nanoserve.slo import SLO

setup = c.SETUPS["paper"]
part = setup.parts[1]
systems = c.configs(setup, SLO(ttft=1.5, tpot=0.110))
out = {}
for seed in (0, 1, 2):
    online = c.online_trace(setup, part, 1.0, seed, setup.online_rate)
    mixed = c.merge_traces(online, c.offline_pool(setup, seed + 2))
    for label in (c.VLLMPP, c.SCHED_ONLY, c.WITH_CKPT, c.CONSERVE):
        st = c.window_stats(c.simulate(systems[label], mixed), setup.duration)
        out[f"{seed}|{label}"] = st
        print(seed, label[:40], round(st["offline_processed_tok_s"]), round(st["online_ttft_p99"], 3),
              round(st["online_token_tpot_p99"], 4), st["swap_outs"], st["restore_blocked"],
              round(st["forward_stall_seconds"], 1), st["blocks_loaded_on_resume"], flush=True)
json.dump(out, open("diag_fig8_paper_slo.json", "w"))
