"""ConServe's experiment (nanoserve/sim/experiments/conserve.py) at ci scale: only the directions
that held with a margin over every seed tried (0-7), never the paper's magnitudes.

Not asserted, because it does not hold robustly here: ConServe's online P99 TTFT below our
stronger vLLM++ (selective, recompute)'s, which preempts offline work for online arrivals at once;
and ConServe's resume loads stall the steps that read them. The experiment's notes say so with
the numbers."""
from __future__ import annotations

import pytest

from nanoserve.sim.experiments import ExperimentResult
from nanoserve.sim.experiments.conserve import (BASELINES, CONSERVE, ONLINE_ONLY, SETUPS, VLLMPP, VLLMPP_SELECTIVE,
                                               offline_pool_size, run)


@pytest.fixture(scope="module")
def result() -> ExperimentResult:
    return run("ci", seed=0)


def stats(result: ExperimentResult, label: str) -> dict[str, float]:
    (cv,) = SETUPS["ci"].cvs
    (row,) = [row for row in result.extra["policies"] if row["run"] == f"{label}, CV={cv:g}"]
    return row


def test_every_request_finishes_and_the_same_trace_feeds_every_policy(result):
    assert len(result.runs) == 1 + len(BASELINES)
    online_arrivals = None
    for label, run_result in result.runs.items():
        assert all(r.finish_reason == "stop" and r.e2e is not None for r in run_result.records), label
        arrivals = [(r.arrival, r.prompt_len, r.output_len) for r in run_result.records if r.priority == "online"]
        assert online_arrivals in (None, arrivals)
        online_arrivals = arrivals
        offline = [r for r in run_result.records if r.priority == "offline"]
        assert len(offline) == (0 if label.startswith(ONLINE_ONLY) else offline_pool_size(SETUPS["ci"]))
    # The pool outlasts the window for every co-serving policy: its throughput is not capped by it.
    assert all(stats(result, label)["offline_left_at_window"] > 0 for label in (VLLMPP, VLLMPP_SELECTIVE, CONSERVE))


def test_conserve_harvests_throughput_beyond_online_only(result):
    conserve, online_only = stats(result, CONSERVE), stats(result, ONLINE_ONLY)
    # Seeds 0-7: 1.11-1.26x in output tokens, 1.55-1.94x in processed (prompt + output) tokens.
    assert conserve["output_tok_s"] > 1.05 * online_only["output_tok_s"]
    assert conserve["processed_tok_s"] > 1.3 * online_only["processed_tok_s"]
    # The online work is still served: most of Online-Only's online tokens come within the window
    # (seeds 0-7: 92-96% of them; the rest come later, delayed by offline work in the steps).
    assert conserve["online_output_tok_s"] > 0.85 * online_only["online_output_tok_s"]
    # Checkpoints save the recomputation vLLM++ pays for its preemptions (seeds 0-7: 1.07-1.11x).
    assert conserve["output_tok_s"] > 1.02 * stats(result, VLLMPP_SELECTIVE)["output_tok_s"]


def test_conserves_copies_use_the_link_and_stall_forwards_only_for_what_they_read(result):
    conserve = stats(result, CONSERVE)
    # Checkpoint saves and resume loads cross the link; only the loads a step reads stall it,
    # so forwards never wait longer than the link was busy.
    assert conserve["link_busy_seconds"] > 0
    assert 0 <= conserve["forward_stall_seconds"] <= conserve["link_busy_seconds"]
    # Policies without a host store move nothing over the link.
    assert stats(result, ONLINE_ONLY)["link_busy_seconds"] == 0 == stats(result, VLLMPP_SELECTIVE)["link_busy_seconds"]
    assert any("link carried" in note for note in result.notes)


def test_the_result_states_its_setup_and_compares_with_the_paper(result):
    assert "synthetic" in result.workload and "A100-40G" in result.title and "Llama-2-7B" in result.title
    metrics = [c.metric for c in result.comparisons]
    assert any("ConServe / Online-Only" in m for m in metrics) and any(f"{VLLMPP} / ConServe" in m for m in metrics)
    # A paper number only where the paper ran that baseline, and always saying which it was.
    for c in result.comparisons:
        assert (c.paper_low is None) == (c.baseline == "none"), c.metric
    assert result.notes
