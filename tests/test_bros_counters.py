"""Issue 45's counters and rules for BROS's experiment (experiments/bros.py):

1. RR's per-class batch composition (sched/round_robin.py `counters`, to hold against bros.txt
   §2.2's "serves them in an interleaving manner at the iteration level") agrees with the batches
   the executor ran.
2. The rates by capacity (`run_rates`, `ideal_rate_ours`): the paper's ratios kept, the top rate
   at the ideal server's capacity, the old rule still available.
3. The runs' counters reach the sweep's rows (`scheduler_stats`), and Fig. 13's comparison is
   With / No Bi-cache, labelled with its figure.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
from test_round_robin_policy import RecordingExecutor

from experiments.bros import (
    FIG13_SYSTEMS,
    PANELS,
    SETUPS,
    compare_fig13,
    fig13_rate,
    fig13_setup,
    ideal_rate_ours,
    run_rates,
    scheduler_stats,
)
from nanoserve.config import SchedulerConfig
from nanoserve.engine import Engine
from nanoserve.memory.blocks import BlockPool
from nanoserve.sampling import SamplingParams
from nanoserve.sched import make_scheduler
from nanoserve.sim.simulation import SimResult

B = 4


def test_round_robin_counters_match_the_batches_it_ran():
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=128, policy="round-robin")
    executor = RecordingExecutor(32)
    engine = Engine(make_scheduler(config, BlockPool(32, B)), executor, tokenizer=None)
    for i in range(3):
        engine.add_request([1] * 5, SamplingParams(max_tokens=3 + i, ignore_eos=True), f"rt{i}", priority="online")
    engine.add_request([2] * 5, SamplingParams(max_tokens=9, ignore_eos=True), "be", priority="offline")
    while engine.has_unfinished_requests():
        engine.step()
    served = [{c.request.priority for c in b.chunks} for b in executor.batches]
    assert all(len(s) == 1 for s in served)  # one class per iteration (§2.2)
    order = ["rt" if s == {"online"} else "be" for s in served]
    counts = engine.scheduler.counters()
    assert counts["rt_iterations"] == order.count("rt") and counts["be_iterations"] == order.count("be")
    for side in ("rt", "be"):
        batches = [b for b, o in zip(executor.batches, order) if o == side]
        assert counts[f"{side}_chunks"] == sum(len(b.chunks) for b in batches)
        assert counts[f"{side}_tokens"] == sum(c.num_tokens for b in batches for c in b.chunks)
    # The turn starts with RT and passes after each iteration; an iteration of the class whose
    # turn it was not (the other had nothing) is a passed turn: here, BE alone at the end.
    expected_turn, passed = "rt", 0
    for side in order:
        passed += side != expected_turn
        expected_turn = "be" if side == "rt" else "rt"
    assert passed > 0 and counts["turn_passed"] == passed
    assert order[:6] == ["rt", "be"] * 3


def test_rates_by_capacity_keep_the_papers_ratios_and_top_at_the_ideal_rate():
    for setup in PANELS.values():
        rates, capacity = run_rates(setup), ideal_rate_ours(setup)
        assert rates[-1] == pytest.approx(capacity, rel=5e-3)
        for ours, paper in zip(rates, setup.rates):
            assert ours / rates[-1] == pytest.approx(paper / setup.rates[-1], rel=1e-2)
        assert run_rates(replace(setup, rate_rule="paper")) == setup.rates
    # The capacity falls with less KV (more in flight is what makes a server's rate) and with
    # longer requests: the rule reads the server, not the policies.
    a = PANELS["a"]
    assert ideal_rate_ours(replace(a, tp=1)) < ideal_rate_ours(a)
    assert run_rates(SETUPS["ci"]) == (run_rates(a)[-1],)  # ci: panel (a)'s top rate
    with pytest.raises(ValueError):
        replace(a, rate_rule="tuned")


def test_fig13_runs_at_the_papers_ten_requests_per_second_on_opt_30b():
    setup = fig13_setup("paper")
    assert (setup.model, setup.tp) == ("OPT-30B", 4)  # §7.4.1: "We serve OPT-30B ..."
    assert fig13_rate(setup) == run_rates(setup)[setup.rates.index(10.0)]
    assert fig13_rate(replace(setup, rate_rule="paper")) == 10.0
    assert set(FIG13_SYSTEMS["No Bi-cache (paged, recompute)"].values()) == {"paged"}


def test_fig13_comparison_is_with_over_without_and_held_to_the_paper_only_at_paper_scale():
    rows = [{"panel": "Fig. 10(b)", "system": "With Bi-cache", "rate": 19.8, "rt_ttft_attainment": 0.6,
             "rt_tpot_attainment": 0.9},
            {"panel": "Fig. 10(b)", "system": "No Bi-cache (paged, recompute)", "rate": 19.8,
             "rt_ttft_attainment": 0.4, "rt_tpot_attainment": 0.0}]
    ttft, tpot = compare_fig13(rows, "paper")
    assert ttft.metric.startswith("Fig. 13: RT TTFT") and ttft.ours == pytest.approx(1.5) and ttft.paper_low == 1.23
    assert tpot.ours == float("inf") and tpot.paper_low == 1.63
    assert all(c.paper_low is None for c in compare_fig13(rows, "ci"))
    # The literal reading of Alg. 1's packing (`no_kv_waiting="close"`): its own pair, shown, not held.
    closed = [dict(row, system=f"{row['system']}, queue closed", rt_ttft_attainment=0.3) for row in rows]
    comparisons = compare_fig13(rows + closed, "paper")
    assert [c.paper_low for c in comparisons] == [1.23, 1.63, None, None]
    assert "queue closed" in comparisons[2].metric and comparisons[2].ours == pytest.approx(1.0)


def test_scheduler_stats_read_the_policy_counters():
    result = SimResult(config=None, records=[], kv_usage=[], events={}, steps=0, busy_seconds=0.0,  # type: ignore[arg-type]
                       link_busy_seconds=0.0, forward_stall_seconds=0.0, duration=1.0,
                       extra={"scheduler_counters": {"plans": 4, "batch_size_sum": 40, "rt_held_sum": 6,
                                                     "be_held_sum": 2, "size_bound": 1, "slo_risk": 2,
                                                     "be_replaced_rt": 3, "be_replace_plans": 1}})
    stats = scheduler_stats(result)
    assert (stats["plans"], stats["size_bound_plans"], stats["risk_plans"], stats["be_replaced_rt"]) == (4, 1, 2, 3)
    assert (stats["mean_size_bound"], stats["mean_rt_per_plan"], stats["mean_be_per_plan"]) == (10, 1.5, 0.5)
    assert stats["rr_rt_iterations"] == 0 and stats["rr_mean_be_batch"] == 0.0  # not RR: no such branch
    rr = replace(result, extra={"scheduler_counters": {"rt_iterations": 2, "be_iterations": 1, "rt_chunks": 6,
                                                       "be_chunks": 5, "turn_passed": 1}})
    stats = scheduler_stats(rr)
    assert (stats["rr_mean_rt_batch"], stats["rr_mean_be_batch"], stats["rr_turn_passed"]) == (3, 5, 1)
