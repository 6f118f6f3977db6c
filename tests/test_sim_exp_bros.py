"""BROS's experiment (experiments/bros.py) at ci scale: OPT-13B at TP=2 on
A100-40G, RT at 10 req/s for 30 s beside 32 BE requests every 10 s. Only directions that held with
a margin at seeds 0-3, never the paper's magnitudes.

BE batches are closed loop, as §7.1 submits them. Seeds 0-3 (the numbers in the comments) with
BROS's batch size doubling after a step without SLO risk and its copies streamed layer by layer;
with +1 growth and open-loop batches, BROS's RT latency was 1.05-1.3x *above* fcfs's."""
from __future__ import annotations

import pytest

from experiments import ExperimentResult
from experiments.bros import BROS, FCFS, POLICIES, RR, SETUPS, VLLM_V0, ablation_variants, be_busy_seconds, run


@pytest.fixture(scope="module")
def result() -> ExperimentResult:
    return run("ci", seed=0)


def row(result: ExperimentResult, system: str) -> dict:
    (rate,) = SETUPS["ci"].rates
    (found,) = [r for r in result.extra["sweep"] if r["system"] == system and r["rate"] == rate]
    return found


def test_every_request_finishes_and_every_policy_sees_the_same_trace(result):
    assert len(result.runs) == len(POLICIES)
    rt_trace, be_lengths = None, []
    for label, run_result in result.runs.items():
        assert all(r.finish_reason == "stop" and r.e2e is not None for r in run_result.records), label
        rt = [(r.arrival, r.prompt_len, r.output_len) for r in run_result.records if r.priority == "online"]
        assert rt_trace in (None, rt)
        rt_trace = rt
        be = [r for r in run_result.records if r.priority == "offline"]
        be_lengths.append([(r.prompt_len, r.output_len) for r in be])
        # Closed loop (§7.1): whole batches, each submitted when the one before it completed.
        batch = SETUPS["ci"].be_batch
        assert len(be) % batch == 0 and len(be) >= 2 * batch, label
        for k in range(batch, len(be), batch):
            completed = max(r.arrival + r.e2e for r in be[k - batch:k])
            assert {r.arrival for r in be[k:k + batch]} == {completed}, label
    shortest = min(map(len, be_lengths))  # the same batches in the same order; how many got in varies
    assert all(lengths[:shortest] == be_lengths[0][:shortest] for lengths in be_lengths)
    assert len(rt_trace) > 200


def test_bros_meets_more_ttft_slos_than_vllm(result):
    # Seeds 0-3: 100% against 45-53% (v1) and 39-50% (v0). RT requests go first by deadline,
    # not by arrival behind a BE batch's prompts.
    bros = row(result, BROS)["rt_ttft_attainment"]
    assert bros > row(result, FCFS)["rt_ttft_attainment"] + 0.08
    assert bros > row(result, VLLM_V0)["rt_ttft_attainment"] + 0.15


def test_bros_rt_latency_beats_vllm_v0(result):
    # Seeds 0-3: v0 / BROS 1.57-1.67x. v0 stalls every running decode while it prefills a prompt.
    assert row(result, VLLM_V0)["rt_norm_latency"] > 1.2 * row(result, BROS)["rt_norm_latency"]


def test_bros_rt_latency_beats_round_robin(result):
    # Seeds 0-3: RR / BROS 1.50-1.58x. RR gives BE every other iteration whatever the RT load.
    assert row(result, RR)["rt_norm_latency"] > 1.3 * row(result, BROS)["rt_norm_latency"]


def test_bros_rt_latency_beats_chunked_prefill_fcfs(result):
    # Seeds 0-3: fcfs / BROS 1.18-1.29x. fcfs serves BE prompts in arrival order beside RT work.
    assert row(result, FCFS)["rt_norm_latency"] > 1.05 * row(result, BROS)["rt_norm_latency"]


def test_be_throughput_bros_keeps_up_with_fcfs_and_beats_round_robin(result):
    # Seeds 0-3: fcfs 5.15-5.28, BROS 4.96-5.31 (0.95-1.03x), RR 3.06-3.21 BE requests per busy
    # second. BROS gives BE what RT leaves, and its copies run under the forwards; RR gives BE
    # half the iterations whatever the RT load. (Copies waited for whole: BROS 0.89-0.94x fcfs.)
    fcfs, bros, rr = (row(result, s)["be_throughput_req_s"] for s in (FCFS, BROS, RR))
    assert 0.9 * fcfs < bros < 1.1 * fcfs and bros > 1.3 * rr
    # ... and the comparisons report it in the orientation the paper uses: BROS / baseline.
    (vs_fcfs,) = [c for c in result.comparisons if c.metric.startswith(f"BE throughput: BROS / {FCFS}, mean")]
    assert vs_fcfs.ours == pytest.approx(bros / fcfs)
    assert vs_fcfs.paper_low is None  # one panel is not the paper's average over three


def ablation(result: ExperimentResult, variant: str) -> dict:
    (found,) = [r for r in result.extra["ablation"] if r["variant"] == variant]
    return found


def test_the_ablation_changes_one_knob_and_its_default_row_is_the_main_run(result):
    assert {r["variant"] for r in result.extra["ablation"]} == set(ablation_variants())
    default, main = ablation(result, "B0=8, x2"), row(result, BROS)
    assert all(default[k] == main[k] for k in ("rt_norm_latency", "be_throughput_req_s", "overwrites"))


def test_copies_streamed_layer_by_layer_hide_under_the_forwards(result):
    # §4.1's max(T_exec, T_swap). Seeds 0-3: forwards wait 0-0.015 s for copies layer by layer,
    # 1.1-1.6 s for whole ones, and BE throughput is 4-10% higher (5 of 31 s of BE time).
    streamed, whole = row(result, BROS), ablation(result, "copies waited for whole")
    assert streamed["forward_stall_s"] < 0.1 * whole["forward_stall_s"]
    assert whole["forward_stall_s"] > 0.5 * whole["link_busy_s"]  # whole: nearly every copy is waited for
    assert streamed["be_throughput_req_s"] > 1.02 * whole["be_throughput_req_s"]


def test_the_bidirectional_memory_is_shared(result):
    # §5 at work (seeds 0-3: 541-937 overwrites, 3.9-9.5k checkpointed BE slots, 2.1-2.5k
    # restored pages); the other policies' managers have no such counters.
    bros = row(result, BROS)
    assert bros["overwrites"] > 100 and bros["checkpointed_slots"] > bros["overwrites"] and bros["restored_pages"] > 0
    assert row(result, FCFS)["overwrites"] == 0


def test_be_busy_time_is_the_union_of_be_request_spans(result):
    run_result = result.runs[f"{SETUPS['ci'].panel} {FCFS} @ {SETUPS['ci'].rates[0]:g} req/s"]
    spans = [(r.arrival, r.arrival + r.e2e) for r in run_result.records if r.priority == "offline"]
    busy = be_busy_seconds(run_result)
    assert max(b - a for a, b in spans) <= busy <= sum(b - a for a, b in spans)
    assert busy <= max(b for _, b in spans) - min(a for a, _ in spans)


def test_kv_copies_are_reported_as_link_time_and_forward_stalls(result):
    # Lazy checkpoints and restores cross the link; forwards wait only for what they read.
    bros = row(result, BROS)
    assert 0 <= bros["forward_stall_s"] <= bros["link_busy_s"]
    assert row(result, FCFS)["link_busy_s"] == 0  # paged KV: nothing crosses the link
