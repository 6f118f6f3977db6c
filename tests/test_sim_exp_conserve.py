"""ConServe's experiment (nanoserve/sim/experiments/conserve.py) at ci scale: only the directions
that held with a margin over every seed tried (0-7), never the paper's magnitudes.

Not asserted, because it does not hold robustly here: ConServe's online P99 TTFT below vLLM++'s
(it won at 4 of 8 seeds). nanoserve's vLLM++ preempts offline work for online arrivals by
recompute, and ConServe's checkpoint loads sit on the step's critical path; the experiment's
notes say so with the numbers."""
from __future__ import annotations

import pytest

from nanoserve.sim.experiments import ExperimentResult
from nanoserve.sim.experiments.conserve import (CONSERVE, ONLINE_ONLY, OVERLAPPED, SETUPS, VLLMPP,
                                                offline_pool_size, run)


@pytest.fixture(scope="module")
def result() -> ExperimentResult:
    return run("ci", seed=0)


def stats(result: ExperimentResult, label: str) -> dict[str, float]:
    (cv,) = SETUPS["ci"].cvs
    (row,) = [row for row in result.extra["policies"] if row["run"] == f"{label}, CV={cv:g}"]
    return row


def test_every_request_finishes_and_the_same_trace_feeds_every_policy(result):
    assert len(result.runs) == 4
    online_arrivals = None
    for label, run_result in result.runs.items():
        assert all(r.finish_reason == "stop" and r.e2e is not None for r in run_result.records), label
        arrivals = [(r.arrival, r.prompt_len, r.output_len) for r in run_result.records if r.priority == "online"]
        assert online_arrivals in (None, arrivals)
        online_arrivals = arrivals
        offline = [r for r in run_result.records if r.priority == "offline"]
        assert len(offline) == (0 if label.startswith(ONLINE_ONLY) else offline_pool_size(SETUPS["ci"]))
    # The pool outlasts the window for every co-serving policy: its throughput is not capped by it.
    assert all(stats(result, label)["offline_left_at_window"] > 0 for label in (VLLMPP, CONSERVE, OVERLAPPED))


def test_conserve_harvests_throughput_beyond_online_only(result):
    conserve, online_only = stats(result, CONSERVE), stats(result, ONLINE_ONLY)
    # Seeds 0-7: 1.11-1.26x in output tokens, 1.55-1.94x in processed (prompt + output) tokens.
    assert conserve["output_tok_s"] > 1.05 * online_only["output_tok_s"]
    assert conserve["processed_tok_s"] > 1.3 * online_only["processed_tok_s"]
    # The online work is still served: most of Online-Only's online tokens come within the window
    # (seeds 0-7: 92-96% of them; the rest come later, delayed by offline work in the steps).
    assert conserve["online_output_tok_s"] > 0.85 * online_only["online_output_tok_s"]
    # Checkpoints save the recomputation vLLM++ pays for its preemptions (seeds 0-7: 1.07-1.11x).
    assert conserve["output_tok_s"] > 1.02 * stats(result, VLLMPP)["output_tok_s"]


def test_overlapping_kv_copies_shortens_conserves_online_token_gaps(result):
    # What the fenced copies cost (seeds 0-7: 128-141 ms overlapped vs 144-194 ms fenced).
    fenced, overlapped = stats(result, CONSERVE), stats(result, OVERLAPPED)
    assert fenced["copy_seconds"] > 0
    assert overlapped["online_token_tpot_p99"] < 0.95 * fenced["online_token_tpot_p99"]


def test_the_result_states_its_setup_and_compares_with_the_paper(result):
    assert "synthetic" in result.workload and "A100-40G" in result.title and "Llama-2-7B" in result.title
    metrics = [c.metric for c in result.comparisons]
    assert any("ConServe / Online-Only" in m for m in metrics) and any("vLLM++ / ConServe" in m for m in metrics)
    assert all(c.paper_low is not None for c in result.comparisons)
    assert result.notes
