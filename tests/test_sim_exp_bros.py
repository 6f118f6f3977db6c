"""BROS's experiment (nanoserve/sim/experiments/bros.py) at ci scale: OPT-13B at TP=2 on
A100-40G, RT at 10 req/s for 30 s beside 32 BE requests every 10 s. Only directions that held with
a margin at seeds 0-3, never the paper's magnitudes.

Not asserted, because the margin is too thin: BROS's RT normalized latency below FastGen-like
fcfs's (vLLM v1's chunked prefill): fcfs / BROS was 1.02-1.06x at seeds 0-3 with BROS's batch
size doubling after a step without SLO risk (1.05-1.3x the other way with +1 growth, which kept
its batches small)."""
from __future__ import annotations

import pytest

from nanoserve.sim.experiments import ExperimentResult
from nanoserve.sim.experiments.bros import BROS, FCFS, POLICIES, RR, SETUPS, VLLM, VLLM_V0, be_busy_seconds, run


@pytest.fixture(scope="module")
def result() -> ExperimentResult:
    return run("ci", seed=0)


def row(result: ExperimentResult, system: str) -> dict:
    (rate,) = SETUPS["ci"].rates
    (found,) = [r for r in result.extra["sweep"] if r["system"] == system and r["rate"] == rate]
    return found


def test_every_request_finishes_and_every_policy_sees_the_same_trace(result):
    assert len(result.runs) == len(POLICIES)
    trace = None
    for label, run_result in result.runs.items():
        assert all(r.finish_reason == "stop" and r.e2e is not None for r in run_result.records), label
        arrivals = [(r.arrival, r.prompt_len, r.output_len, r.priority) for r in run_result.records]
        assert trace in (None, arrivals)
        trace = arrivals
    setup = SETUPS["ci"]
    assert sum(p == "offline" for *_, p in trace) == setup.be_batch * round(setup.duration / setup.be_period)
    assert sum(p == "online" for *_, p in trace) > 200


def test_bros_meets_more_ttft_slos_than_vllm(result):
    # Seeds 0-3: 100% against 74-83% (v1) and 56-74% (v0). RT requests go first by deadline,
    # not by arrival behind a BE batch's prompts.
    bros = row(result, BROS)["rt_ttft_attainment"]
    assert bros > row(result, FCFS)["rt_ttft_attainment"] + 0.08
    assert bros > row(result, VLLM_V0)["rt_ttft_attainment"] + 0.15


def test_bros_rt_latency_beats_vllm_v0(result):
    # Seeds 0-3: v0 / BROS 1.42-1.52x. v0 stalls every running decode while it prefills a prompt.
    assert row(result, VLLM_V0)["rt_norm_latency"] > 1.2 * row(result, BROS)["rt_norm_latency"]


def test_bros_rt_latency_beats_round_robin(result):
    # Seeds 0-3: RR / BROS 1.51-1.66x. RR gives BE every other iteration whatever the RT load.
    assert row(result, RR)["rt_norm_latency"] > 1.3 * row(result, BROS)["rt_norm_latency"]


def test_be_throughput_orders_vllm_bros_round_robin(result):
    # Seeds 0-3: vLLM 5.8-6.1, BROS 5.3-5.9 (3-8% less), RR 3.2-3.6 BE requests per busy second.
    # BROS gives BE what RT leaves (the paper's direction: it loses some), RR half the iterations.
    vllm, bros, rr = (row(result, s)["be_throughput_req_s"] for s in (FCFS, BROS, RR))
    assert vllm > 1.01 * bros and bros > 1.3 * rr
    # ... and the comparisons report it in the orientation the paper uses: BROS / baseline.
    (vs_vllm,) = [c for c in result.comparisons if c.metric.startswith(f"BE throughput: BROS / {FCFS} at")]
    assert vs_vllm.ours == pytest.approx(bros / vllm)


def test_be_busy_time_is_the_union_of_be_request_spans(result):
    run_result = result.runs[f"{FCFS} @ {SETUPS['ci'].rates[0]:g} req/s"]
    spans = [(r.arrival, r.arrival + r.e2e) for r in run_result.records if r.priority == "offline"]
    busy = be_busy_seconds(run_result)
    assert max(b - a for a, b in spans) <= busy <= sum(b - a for a, b in spans)
    assert busy <= max(b for _, b in spans) - min(a for a, _ in spans)


def test_kv_copies_are_reported_as_link_time_and_forward_stalls(result):
    # Lazy checkpoints and restores cross the link; forwards wait only for what they read.
    bros = row(result, BROS)
    assert 0 <= bros["forward_stall_s"] <= bros["link_busy_s"]
    assert row(result, FCFS)["link_busy_s"] == 0  # paged KV: nothing crosses the link
