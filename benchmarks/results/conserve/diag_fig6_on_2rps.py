"""Diagnostic for RESULTS.md (issue 45, ConServe): Fig. 6's ON/OFF trace with the ON phases at 2 req/s
(Fig. 7's rate) instead of the derived 0.6, seeds 0-2. Run from the checkout root:
PYTHONPATH=. python benchmarks/results/conserve/diag_fig6_on_2rps.py"""
from experiments import conserve as c

setup = c.SETUPS["paper"]
d = c.derive("paper")
systems = c.configs(setup, d.slo)
for seed in (0, 1, 2):
    online6 = c.fig6_trace(setup, 2.0, seed)
    mixed6 = c.merge_traces(online6, c.offline_pool(setup, seed + 2, setup.fig6_duration))
    for label in (c.VLLMPP, c.CONSERVE, c.CAPPED):
        st = c.fig6_stats(c.simulate(systems[label], mixed6), setup)
        print(seed, label[:30], {k: round(v, 3) for k, v in st.items()}, flush=True)
