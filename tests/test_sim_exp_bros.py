"""BROS's experiment (experiments/bros.py) at ci scale: OPT-13B at TP=2 on
A100-40G, RT at panel (a)'s ideal RT capacity (20.5 req/s, issue 45's rates by capacity) for 30 s
beside closed-loop batches of 32 BE requests. Only directions that held with a margin at seeds
0-2, never the paper's magnitudes.

BE batches are closed loop, as §7.1 submits them. Seeds 0-2 (the numbers in the comments) with
BROS's batch size doubling after a step without SLO risk and its copies streamed layer by layer.
At the paper's 10 req/s (the rule before issue 45) the server was far from full: BROS kept more
BE throughput than every baseline, the opposite of the paper's trade-off."""
from __future__ import annotations

import pytest

from experiments import ExperimentResult
from experiments.bros import (
    BROS,
    CI_ABLATION,
    FCFS,
    POLICIES,
    RR,
    SETUPS,
    VLLM,
    VLLM_V0,
    ablation_variants,
    be_busy_seconds,
    run,
    run_rates,
)


@pytest.fixture(scope="module")
def result() -> ExperimentResult:
    return run("ci", seed=0)


def row(result: ExperimentResult, system: str) -> dict:
    (rate,) = run_rates(SETUPS["ci"])
    (found,) = [r for r in result.extra["sweep"] if r["system"] == system and r["rate"] == rate]
    return found


def test_every_request_finishes_and_every_policy_sees_the_same_trace(result):
    assert len([label for label in result.runs if not label.startswith("Fig. 13")]) == len(POLICIES)
    assert len(result.runs) == len(POLICIES) + 1  # Fig. 13's No Bi-cache run; With is the sweep's BROS run
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


def test_at_capacity_the_baselines_miss_most_ttfts_and_bros_meets_more(result):
    # Seeds 0-2: vLLM (2023) 18-20%, v0 14-20%, fcfs 11-16%, RR 21-32%; BROS 74-77%. The paper's
    # regime (its vLLM 1.28%, its BROS ~47%): RT requests go first by deadline, not by arrival
    # behind a BE batch's prompts.
    bros = row(result, BROS)["rt_ttft_attainment"]
    assert row(result, VLLM)["rt_ttft_attainment"] < 0.35
    for baseline in (VLLM, FCFS, VLLM_V0, RR):
        assert bros > row(result, baseline)["rt_ttft_attainment"] + 0.3, baseline


def test_bros_rt_latency_beats_vllm_v0(result):
    # Seeds 0-2: v0 / BROS 2.96-3.12x, vLLM (2023) / BROS 2.56-2.66x. Both stall every running
    # decode while they prefill a prompt.
    assert row(result, VLLM_V0)["rt_norm_latency"] > 2 * row(result, BROS)["rt_norm_latency"]
    assert row(result, VLLM)["rt_norm_latency"] > 1.8 * row(result, BROS)["rt_norm_latency"]


def test_bros_rt_latency_beats_round_robin(result):
    # Seeds 0-2: RR / BROS 2.77-3.43x. RR runs BE batches in turns whatever the RT load.
    assert row(result, RR)["rt_norm_latency"] > 2 * row(result, BROS)["rt_norm_latency"]


def test_bros_rt_latency_beats_chunked_prefill_fcfs(result):
    # Seeds 0-2: fcfs / BROS 2.12-2.18x. fcfs serves BE prompts in arrival order beside RT work.
    assert row(result, FCFS)["rt_norm_latency"] > 1.5 * row(result, BROS)["rt_norm_latency"]


def test_bros_gives_up_be_throughput_for_rt_as_the_paper_does(result):
    # Seeds 0-2: BE requests per busy second, BROS 1.46-1.50 against fcfs 2.42-2.69 (0.56-0.60x),
    # vLLM (2023) 2.22-2.74 (0.54-0.66x), RR 1.93-2.11 (0.69-0.78x): the paper's direction (0.89x
    # vLLM, 0.91x RR), further. BROS's plans carry 73-76 RT requests and 2.6-2.9 BE ones.
    fcfs, bros, rr, vllm = (row(result, s)["be_throughput_req_s"] for s in (FCFS, BROS, RR, VLLM))
    assert bros < 0.8 * fcfs and bros < 0.85 * vllm and bros < 0.9 * rr
    # ... and the comparisons report it in the orientation the paper uses: BROS / baseline, each
    # beside its RT latency ratio, both labelled with the figure.
    (vs_rr,) = [c for c in result.comparisons if c.metric.startswith(f"Fig. 10: BE throughput: BROS / {RR}, mean")]
    assert vs_rr.ours == pytest.approx(bros / rr)
    assert vs_rr.paper_low is None  # one panel is not the paper's average over three
    assert any(c.metric.startswith(f"Fig. 10: RT normalized latency: {RR} / BROS") for c in result.comparisons)


def test_fig13_the_bidirectional_cache_cuts_rt_latency_and_keeps_be_throughput(result):
    # Seeds 0-2: No Bi-cache (BROS over paged KV, recompute) / With: RT normalized latency
    # 1.38-1.45x, BE throughput With / No 1.26-1.33x. TTFT attainment goes the other way
    # (With / No 0.86-0.94x; the paper: 1.23x) and TPOT is met by both (the paper: 1.63x).
    (with_bi,) = [r for r in result.extra["fig13"] if r["system"] == "With Bi-cache"]
    (no_bi,) = [r for r in result.extra["fig13"] if r["system"] != "With Bi-cache"]
    assert with_bi["rt_norm_latency"] == row(result, BROS)["rt_norm_latency"]  # the sweep's run, reused
    assert no_bi["overwrites"] == 0 and no_bi["link_busy_s"] == 0  # paged: nothing shared, nothing copied
    assert no_bi["rt_norm_latency"] > 1.25 * with_bi["rt_norm_latency"]
    assert with_bi["be_throughput_req_s"] > 1.15 * no_bi["be_throughput_req_s"]
    assert {c.metric.split(":")[0] for c in result.comparisons if "Bi-cache" in c.metric} == {"Fig. 13"}


def test_constraint_7_and_be_replacing_rt_fire_at_capacity(result):
    # Seeds 0-2, default B0 = 8, x2: the bound met a candidate in 21-65 of ~1,800 plans and a BE
    # request replaced an RT one 365-405 times; with B0 = 256 (= max_num_seqs) the bound never
    # met one, and nothing was replaced. B0 = 8 with +1 keeps the bound low (mean 136-163):
    # 0.093-0.122 s/token against 0.047-0.049.
    bros = row(result, BROS)
    assert bros["size_bound_plans"] > 0 and bros["be_replaced_rt"] > 100
    widest = ablation(result, "B0=256, x2")
    assert widest["size_bound_plans"] == 0 and widest["be_replaced_rt"] == 0
    assert ablation(result, "B0=8, +1")["rt_norm_latency"] > 1.5 * bros["rt_norm_latency"]
    rr = row(result, RR)  # §2.2: one class per iteration, RT's turn taken whenever BE has nothing to run
    assert rr["rr_rt_iterations"] > 0 and rr["rr_be_iterations"] > 0 and rr["rr_turn_passed"] > 0


def ablation(result: ExperimentResult, variant: str) -> dict:
    (found,) = [r for r in result.extra["ablation"] if r["variant"] == variant]
    return found


def test_the_ablation_changes_one_knob_and_its_default_row_is_the_main_run(result):
    assert {r["variant"] for r in result.extra["ablation"]} == set(CI_ABLATION) <= set(ablation_variants())
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
    run_result = result.runs[f"{SETUPS['ci'].panel} {FCFS} @ {run_rates(SETUPS['ci'])[0]:g} req/s"]
    spans = [(r.arrival, r.arrival + r.e2e) for r in run_result.records if r.priority == "offline"]
    busy = be_busy_seconds(run_result)
    assert max(b - a for a, b in spans) <= busy <= sum(b - a for a, b in spans)
    assert busy <= max(b for _, b in spans) - min(a for a, _ in spans)


def test_kv_copies_are_reported_as_link_time_and_forward_stalls(result):
    # Lazy checkpoints and restores cross the link; forwards wait only for what they read.
    bros = row(result, BROS)
    assert 0 <= bros["forward_stall_s"] <= bros["link_busy_s"]
    assert row(result, FCFS)["link_busy_s"] == 0  # paged KV: nothing crosses the link
