"""ConServe's experiment (experiments/conserve.py) at ci scale: the mechanisms'
counts, and only the directions that held with a margin over every seed tried (0-4), never the
paper's magnitudes (the notes and RESULTS.md compare those at paper scale)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments import ExperimentResult
from experiments import conserve as conserve_experiment
from experiments.conserve import (
    BASELINES,
    BURSTGPT,
    CAPPED,
    CONSERVE,
    FIG5,
    FIG6,
    FIG6_SYSTEMS,
    FIG8_CV,
    FIG78,
    FIXED,
    ONLINE_ONLY,
    SCHED_ONLY,
    SETUPS,
    VLLMPP,
    VLLMPP_SELECTIVE,
    WITH_CKPT,
    derive,
    offline_pool_size,
    run,
    run_label,
)

PARTS = {part.figure: part for part in SETUPS["ci"].parts}


@pytest.fixture(scope="module")
def points(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("conserve") / "seed0.jsonl"


@pytest.fixture(scope="module")
def result(points) -> ExperimentResult:
    return run("ci", seed=0, points=points)


def stats(result: ExperimentResult, label: str, figure: str) -> dict[str, float]:
    if figure == FIG6:
        (row,) = [row for row in result.extra["ablation"] if row["run"] == run_label(label, FIG6)]
        return row
    part = PARTS[figure]
    (cv,) = part.cvs
    (row,) = [row for row in result.extra["policies"] if row["run"] == run_label(label, part, cv)]
    return row


def test_slos_and_loads_follow_the_papers_procedure():
    """§6.2: the SLOs are Online-Only's P99s on Fig. 5's load (the paper's 1,999 tok/s of our
    BurstGPT-like requests); R is the highest rate Online-Only serves within them (the next grid
    rate up misses on some calibration seed), for Fig. 5's lengths and for Fig. 6's."""
    setup, derived = SETUPS["ci"], derive("ci")
    assert setup.slo_rate == pytest.approx(1999 / (642 + 262))
    defining = [p for p in derived.probes if p["workload"].startswith("SLO")]
    assert len(defining) == len(setup.calibration_seeds)
    assert derived.slo.ttft == max(p["ttft_p99"] for p in defining)
    assert derived.slo.tpot == max(p["token_tpot_p99"] for p in defining)
    assert derived.fig5_rate >= round(setup.slo_rate, 4)
    for lengths, rate in ((BURSTGPT, derived.fig5_rate), (FIXED, derived.fig6_rate)):
        probes = [p for p in derived.probes if p["workload"] == lengths.name]
        at = [p for p in probes if p["req_s"] == pytest.approx(rate)]
        above = [p for p in probes if p["req_s"] == pytest.approx(rate + setup.rate_step)]
        assert all(p["within_slo"] for p in at) and above and not all(p["within_slo"] for p in above)
    assert derived.fig6_rate > 0


def test_every_request_finishes_and_the_same_trace_feeds_every_policy(result):
    assert len(result.runs) == len(PARTS) * (1 + len(BASELINES)) + 2 + len(FIG6_SYSTEMS)  # + Fig. 8's two bars
    for label in FIG6_SYSTEMS:
        assert all(r.finish_reason == "stop" for r in result.runs[run_label(label, FIG6)].records), label
    for figure, part in PARTS.items():
        online_arrivals = None
        for label in [b.label for b in BASELINES] + [CONSERVE]:
            run_result = result.runs[run_label(label, part, part.cvs[0])]
            assert all(r.finish_reason == "stop" and r.e2e is not None for r in run_result.records), label
            arrivals = [(r.arrival, r.prompt_len, r.output_len) for r in run_result.records if r.priority == "online"]
            assert online_arrivals in (None, arrivals)
            online_arrivals = arrivals
            offline = [r for r in run_result.records if r.priority == "offline"]
            assert len(offline) == (0 if label == ONLINE_ONLY else offline_pool_size(SETUPS["ci"]))
        # The pool outlasts the window for every co-serving policy: its throughput is not capped by it.
        assert all(stats(result, label, figure)["offline_left_at_window"] > 0
                   for label in (VLLMPP, VLLMPP_SELECTIVE, CONSERVE))
    # §6.3's online requests are 1,024 tokens in, 128 out.
    fixed = result.runs[run_label(ONLINE_ONLY, PARTS[FIG78], PARTS[FIG78].cvs[0])].records
    assert {(r.prompt_len, r.output_len) for r in fixed} == {(1024, 128)}


def test_checkpoints_keep_what_preemption_drops_and_prefetch_runs_ahead(result):
    for figure in PARTS:
        conserve = stats(result, CONSERVE, figure)
        # Seeds 0-4: 99.8-99.9% (only partly filled tail blocks are recomputed); the issue asks >= 80%.
        assert conserve["preempted_tokens_kept"] >= 0.8
        assert conserve["pauses"] > 0  # over-budget requests kept their K/V on the device
        # Loads go out ahead of the step that runs their request (seeds 0-4: <= 0.2% in it).
        assert conserve["blocks_loaded_ahead"] > 0
        assert conserve["blocks_loaded_on_resume"] <= 0.02 * conserve["blocks_loaded_ahead"]
        # ...so forwards barely wait for them (seeds 0-4: <= 3% of the link's busy time).
        assert 0 <= conserve["forward_stall_seconds"] <= 0.1 * conserve["link_busy_seconds"]
    # Policies without a host store move nothing over the link.
    assert stats(result, ONLINE_ONLY, FIG5)["link_busy_seconds"] == 0 == stats(result, VLLMPP_SELECTIVE, FIG5)[
        "link_busy_seconds"]


def test_conserve_harvests_throughput_beyond_online_only_and_vllmpp(result):
    conserve, online_only = stats(result, CONSERVE, FIG5), stats(result, ONLINE_ONLY, FIG5)
    # Seeds 0-4 (SLOs by §6.2's procedure, Fig. 5 at R): 1.79-2.41x processed (paper, Fig. 5: 1.85x),
    # 1.27-1.45x output.
    assert conserve["processed_tok_s"] > 1.5 * online_only["processed_tok_s"]
    assert conserve["output_tok_s"] > 1.15 * online_only["output_tok_s"]
    # The online work is still served within the window (seeds 0-4: 97-98% of Online-Only's tokens).
    assert conserve["online_output_tok_s"] > 0.9 * online_only["online_output_tok_s"]
    # Checkpoints save the recomputation our selective vLLM++ pays (seeds 0-4: 1.46-1.50x).
    assert conserve["processed_tok_s"] > 1.2 * stats(result, VLLMPP_SELECTIVE, FIG5)["processed_tok_s"]
    # Fig. 8's setup: more offline work than the paper's vLLM++ (seeds 0-4: 1.01-1.09x; paper 1.04x).
    assert stats(result, CONSERVE, FIG78)["offline_processed_tok_s"] > stats(result, VLLMPP, FIG78)[
        "offline_processed_tok_s"]


def test_conserve_keeps_online_ttft_below_vllmpp_and_near_online_only(result):
    for figure in PARTS:  # seeds 0-4: 1.7-3.7x (Fig. 5), 2.7-9.1x (Fig. 7/8) lower than vLLM++ (swap)
        assert (stats(result, VLLMPP, figure)["online_ttft_p99"]
                > 1.5 * stats(result, CONSERVE, figure)["online_ttft_p99"])
    # Seeds 0-4: Online-Only's P99 TTFT is 0.43-1.01x ConServe's (paper: within 25%, i.e. >= 0.8x;
    # with the SLOs by §6.2's procedure, 284 / 67 ms at ci scale; 0.77-0.89x with 1,500 / 110 ms).
    assert (stats(result, ONLINE_ONLY, FIG78)["online_ttft_p99"]
            > 0.4 * stats(result, CONSERVE, FIG78)["online_ttft_p99"])


def test_fig8_bars_prefetch_recovers_throughput_and_the_scheduler_cuts_ttft(result):
    assert FIG8_CV in PARTS[FIG78].cvs
    vllmpp, sched = stats(result, VLLMPP, FIG78), stats(result, SCHED_ONLY, FIG78)
    ckpt, full = stats(result, WITH_CKPT, FIG78), stats(result, CONSERVE, FIG78)
    key = "offline_processed_tok_s"
    # Seeds 0-4: the scheduler alone costs offline throughput against vLLM++ (0.17-0.30x; paper
    # 0.80x): its over-budget pauses are swaps; and prefetch recovers it (+ prefetch / +
    # checkpointing 2.2-4.7x; paper 1.136x). + checkpointing / scheduler only is 0.81-2.28x: no
    # direction asserted.
    assert sched[key] < 0.5 * vllmpp[key] and full[key] > 2 * ckpt[key]
    assert sched["swap_outs"] > 0 and ckpt["swap_outs"] == 0
    assert ckpt["blocks_loaded_on_resume"] > 0 and ckpt["blocks_loaded_ahead"] == 0
    # P99 TTFT: ConServe 0.19-0.47x the scheduler-only bar's (seeds 0-4).
    assert full["online_ttft_p99"] < 0.6 * sched["online_ttft_p99"]


def test_fig6_on_off_keeps_online_latency_below_vllmpp(result):
    conserve, vllmpp = stats(result, CONSERVE, FIG6), stats(result, VLLMPP, FIG6)
    # Seeds 0-4: vLLM++ / ConServe P99 TTFT 1.40-10.9x, per-token TPOT 2.2-2.6x (paper: 1.4-11x).
    assert vllmpp["online_ttft_p99"] > 1.2 * conserve["online_ttft_p99"]
    assert vllmpp["online_token_tpot_p99"] > 2 * conserve["online_token_tpot_p99"]
    # The OFF phase runs in the offline batching mode, past 2,048 tokens a step where memory allows.
    assert conserve["off_offline_processed_tok_s"] > 0 and conserve["offline_batching_big_steps"] > 0
    assert stats(result, CAPPED, FIG6)["offline_batching_big_steps"] == 0


def test_the_result_states_its_setup_and_compares_with_the_paper(result):
    assert "synthetic" in result.workload and "A100-40G" in result.title and "Llama-2-7B" in result.title
    metrics = [c.metric for c in result.comparisons]
    assert any("ConServe / Online-Only" in m for m in metrics) and any(f"{VLLMPP} / ConServe" in m for m in metrics)
    assert any(c.paper_low == 1.85 for c in result.comparisons)  # Fig. 5's own numbers, not the abstract's
    # A paper number only where the paper ran that baseline, and always saying which it was.
    for c in result.comparisons:
        assert (c.paper_low is None) == (c.baseline == "none"), c.metric
    assert any("link carried" in note for note in result.notes)
    assert any("SLOs by §6.2's procedure" in note for note in result.notes)
    # Every comparison names its figure (issue 45).
    assert all("Fig. " in c.metric for c in result.comparisons)


def test_a_run_resumes_from_its_saved_points(result, points, monkeypatch):
    """Every run the experiment made is a saved point; started again on the file, it simulates
    nothing and comes to the same comparisons (a stopped paper-scale seed resumes)."""
    lines = points.read_text().splitlines()
    assert len(lines) == len(result.extra["policies"]) + len(result.extra["ablation"])

    def no_simulation(*args, **kwargs):
        raise AssertionError("a saved point was simulated again")

    monkeypatch.setattr(conserve_experiment, "simulate", no_simulation)
    again = run("ci", seed=0, points=points)
    assert [c.ours for c in again.comparisons] == [c.ours for c in result.comparisons]
    same = json.dumps  # NaN (a counter with nothing to count) is equal to itself only as text
    assert same(again.extra["policies"]) == same(result.extra["policies"]) and not again.runs
    assert points.read_text().splitlines() == lines


def test_the_fig8_plot_reads_saved_points(points, tmp_path):
    """`python -m experiments.conserve_fig8` draws Fig. 8's bars from points files alone, each
    over vLLM++'s on the same seed; a file without Fig. 8's runs is refused."""
    pytest.importorskip("matplotlib")
    from experiments import conserve_fig8

    ratios = conserve_fig8.fig8_over_vllmpp(points)
    assert ratios["offline_processed_tok_s"][VLLMPP] == 1.0 == ratios["online_ttft_p99"][VLLMPP]
    rows = {json.loads(line)["key"].split("|")[1]: json.loads(line)["row"] for line in points.read_text().splitlines()}
    full, pp = rows[run_label(CONSERVE, FIG78, FIG8_CV)], rows[run_label(VLLMPP, FIG78, FIG8_CV)]
    assert ratios["online_ttft_p99"][CONSERVE] == full["online_ttft_p99"] / pp["online_ttft_p99"]
    partial = tmp_path / "partial.jsonl"
    partial.write_text("\n".join(line for line in points.read_text().splitlines() if "checkpointing" not in line))
    with pytest.raises(ValueError, match="no Fig. 8 point of ConServe: \\+ incremental checkpointing"):
        conserve_fig8.fig8_over_vllmpp(partial)
    out = conserve_fig8.plot([points, points], tmp_path / "fig8.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
