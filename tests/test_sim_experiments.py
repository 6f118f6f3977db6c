"""The experiment framework, the EcoServe experiment at CI scale, and examples/simulate.py.

Only directions with a margin are asserted (issue 7): who wins, never exact numbers."""
from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

from experiments import EXPERIMENTS, Comparison, ExperimentResult, run_experiment
from experiments import ecoserve as ecoserve_experiment
from experiments.baselines import BASELINES, FASTGEN, ORCA, VLLM_2023, markdown
from experiments.ecoserve import sustained_rate
from experiments.report import comparison_table, format_report, save_json

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ecoserve() -> ExperimentResult:
    return run_experiment("ecoserve", "ci")


def test_unknown_experiment_and_scale_are_rejected():
    with pytest.raises(ValueError, match="unknown experiment"):
        run_experiment("orca")
    with pytest.raises(ValueError, match="scale"):
        run_experiment("ecoserve", "huge")
    assert set(EXPERIMENTS) == {"kunserve", "ecoserve", "bros", "conserve", "all"}


def test_sustained_rate_interpolates_the_crossing():
    points = [(1.0, 0.02), (2.0, 0.03), (3.0, 0.05)]
    assert sustained_rate(points, 0.04) == pytest.approx(2.5)
    assert sustained_rate(points, 1.0) == 3.0  # never crossed: the highest rate, a lower bound
    assert sustained_rate(points, 0.01) == pytest.approx(0.5)  # over at the lowest rate already


def test_comparison_verdicts():
    table = comparison_table([Comparison("a", 3.0, "2-4x", 2.0), Comparison("b", 1.5, "2-4x", 2.0),
                              Comparison("c", 0.8, "2-4x", 2.0)])
    assert "| a | 3.00x | 2-4x | - | yes |" in table
    assert "| b | 1.50x | 2-4x | - | direction only |" in table
    assert "| c | 0.80x | 2-4x | - | no |" in table
    labelled = comparison_table([Comparison("d", 3.0, "2-4x", 2.0, "vLLM with swapping (Fig. 10)")])
    assert "| d | 3.00x | 2-4x | vLLM with swapping (Fig. 10) | yes |" in labelled


def test_ecoserve_datasets_take_the_papers_settings_and_scaled_rates():
    datasets = ecoserve_experiment.DATASETS
    assert [(d.padding_ratio, d.reserved_fraction, d.pipeline_buffer_ratio) for d in datasets.values()] == [
        (0.15, 0.03, 0.15), (0.10, 0.012, 0.15), (0.20, 0.05, 0.10)]  # ShareGPT, Alpaca, BookCorpus
    assert datasets["sharegpt"].rates == ecoserve_experiment.RATES
    ideal = {name: ecoserve_experiment.ideal_rate(d.lengths) for name, d in datasets.items()}
    # Short Alpaca requests fit many at once; BookCorpus's long prompts few, and cost prefill time.
    assert ideal["alpaca"] > 10 * ideal["sharegpt"] > 100 * ideal["bookcorpus"]
    for name in ("alpaca", "bookcorpus"):
        for scale, rates in ecoserve_experiment.RATES.items():
            expected = [rate * ideal[name] / ideal["sharegpt"] for rate in rates]
            assert datasets[name].rates[scale] == pytest.approx(expected, rel=5e-3)
    assert ecoserve_experiment.REQUESTS["paper"] >= 10_000
    with pytest.raises(ValueError, match="datasets"):
        ecoserve_experiment.run("ci", datasets=("imdb",))


def test_ideal_rate_follows_the_roofline():
    # Twice the output per request at the same prompt: fewer fit in the KV and each takes longer.
    from nanoserve.sim.workloads import LengthDist
    short, long = LengthDist("short", 100, 100), LengthDist("long", 100, 200)
    assert ecoserve_experiment.ideal_rate(short) > 1.5 * ecoserve_experiment.ideal_rate(long)


def _points(result: ExperimentResult, dataset: str, system: str) -> list[tuple[float, float]]:
    return sorted((row["rate"], row["norm_latency"]) for row in result.extra["sweep"]
                  if row["dataset"] == dataset and row["system"] == system)


def test_ecoserve_beats_max_allocation_and_every_request_finishes(ecoserve):
    assert list(ecoserve.extra["sustained_rate"]) == ["ShareGPT"]  # CI runs ShareGPT only
    sustained = ecoserve.extra["sustained_rate"]["ShareGPT"]
    # ORCA's max-allocation with batch 8 saturates far below both paged and exact allocation.
    assert sustained["EcoServe"] > 2 * sustained[ORCA.label]
    assert sustained[FASTGEN.label] > 2 * sustained[ORCA.label]
    assert set(ecoserve.runs) == set(sustained)  # every system ran the table rate
    for result in ecoserve.runs.values():
        assert all(r.finish_reason == "stop" for r in result.records)
    for row in ecoserve.extra["sweep"]:  # EcoServe's rows carry its KV manager's counters
        assert (row["events"] is not None) == row["system"].startswith("EcoServe")
        if row["events"] is not None:
            assert row["events"]["admissions"] > 0


def test_ecoserve_reports_fig_10s_ssr_and_fig_11s_ablation(ecoserve):
    rows = ecoserve.extra["sweep"]
    assert all(0 <= row["ssr"] <= 1 and row["ttft_p99"] > 0 for row in rows)
    # Fig. 10 j-l: EcoServe meets the JCT SLO far more often than ORCA's max-allocation.
    ssr = {c.metric: c.ours for c in ecoserve.comparisons if " SSR " in c.metric}
    assert len(ssr) == 3 and ssr[next(m for m in ssr if m.endswith(ORCA.label))] > 1.2
    ablation = ecoserve.extra["ablation"]
    systems = [s.label for s in ecoserve_experiment.ABLATION]
    rates = ecoserve_experiment.ABLATION_RATES["ci"]
    assert [(r["rate"], r["system"], r["scheduling"]) for r in ablation] == [
        (rate, s, p) for rate in rates for p in ("flat", "measured") for s in systems]
    by = {(r["system"], r["scheduling"]): r for r in ablation if r["rate"] == rates[0]}
    assert by["EcoServe", "flat"]["events"]["spills"] == 0  # long prompts decoupled (§3.2.1)
    assert by["EcoServe", "flat"]["events"]["prompt_admissions_available"] > 0
    assert by["EcoServe, long prompts coupled", "flat"]["events"]["spills"] > 0
    assert by["EcoServe-SDO", "flat"]["events"]["hosted_placements"] == 0  # KVCPipeline off
    assert by["EcoServe", "flat"]["events"]["hosted_placements"] > 0
    assert by[VLLM_2023.label, "measured"]["jct_lower_than_vllm"] == 0
    assert all(r["plan_ms_per_step"] > 0 for r in ablation)
    assert sum(c.metric.startswith("Fig. 11") for c in ecoserve.comparisons) == 4 * len(rates)


def test_ecoserve_sweep_stops_a_system_only_past_twice_the_threshold(ecoserve):
    rates = ecoserve.extra["rates"]["ShareGPT"]
    stop = ecoserve_experiment.STOP_FACTOR * ecoserve.extra["threshold_s_per_token"]["ShareGPT"]
    table_rate = ecoserve.extra["table_rate"]
    stopped = 0
    for system in ecoserve.extra["sustained_rate"]["ShareGPT"]:
        points = _points(ecoserve, "ShareGPT", system)
        ran = [rate for rate, _ in points]
        skipped = [rate for rate in rates if rate not in ran]
        assert ran[0] == rates[0] and set(ran) <= set(rates)
        if skipped:  # past the stop line before its first skipped rate; after it, only the table rate
            stopped += 1
            assert max(latency for rate, latency in points if rate < skipped[0]) > stop
            assert all(rate < skipped[0] or rate == table_rate for rate in ran)
    assert stopped >= 1  # ORCA, far over at the CI scale's higher rates


def test_ecoserve_latency_rises_with_the_rate(ecoserve):
    for system in ecoserve.extra["sustained_rate"]["ShareGPT"]:
        points = _points(ecoserve, "ShareGPT", system)
        assert points[-1][1] > points[0][1]


def test_sweep_plot_draws_a_panel_per_dataset(ecoserve, tmp_path):
    pytest.importorskip("matplotlib")
    from experiments.report import save_plots
    rows = [dict(row, dataset=name) for name in ("ShareGPT", "Alpaca") for row in ecoserve.extra["sweep"]]
    threshold = ecoserve.extra["threshold_s_per_token"]["ShareGPT"]
    fake = ExperimentResult("eco-two", "two datasets", "synthetic", {}, [],
                            extra={"sweep": rows,
                                   "threshold_s_per_token": {"ShareGPT": threshold, "Alpaca": threshold}})
    (path,) = save_plots(fake, tmp_path)
    assert path.name == "eco-two-sweep.png" and path.stat().st_size > 0


def test_report_and_json_say_synthetic(ecoserve, tmp_path):
    text = format_report(ecoserve)
    assert "synthetic" in text and "EcoServe / ORCA" in text and "Sweep:" in text
    data = save_json(ecoserve, tmp_path / "eco.json")
    assert "synthetic" in data["workload_note"]
    assert json.loads((tmp_path / "eco.json").read_text())["extra"]["comparisons"][0]["paper"].startswith(
        "2.5-4x higher on ShareGPT")


def test_simulate_example_writes_json_and_plots(ecoserve, tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    import experiments as experiments
    monkeypatch.setattr(experiments, "run_experiment", lambda name, scale, seed: ecoserve)  # ran once already
    monkeypatch.setattr(sys, "argv", ["simulate.py", "ecoserve", "--scale", "ci", "--json",
                                      str(tmp_path / "out.json"), "--plot", str(tmp_path / "plots")])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(ROOT / "examples" / "simulate.py"), run_name="__main__")
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "reaches the paper's low end" in out
    assert (tmp_path / "out.json").exists()
    pngs = sorted(p.name for p in (tmp_path / "plots").glob("*.png"))
    assert "ecoserve-sweep.png" in pngs and "ecoserve-latency-cdf.png" in pngs


def test_simulate_example_runs_several_seeds_and_tables_every_ratio(tmp_path, monkeypatch, capsys):
    import experiments as experiments

    def fake(name, scale, seed):  # a ratio that moves with the seed; one comparison only seed 1 has
        comparisons = [Comparison("A / B", 2.0 + seed, "2-4x higher", 2.0, "B (Fig. 1)")]
        comparisons += [Comparison("A / C", 0.5, "(not run by the paper)")] if seed == 1 else []
        return ExperimentResult("fake", "t", "synthetic", {}, comparisons)
    monkeypatch.setattr(experiments, "run_experiment", fake)
    monkeypatch.setattr(sys, "argv", ["simulate.py", "ecoserve", "--seed", "0", "1", "2", "--json",
                                      str(tmp_path / "out.json")])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(ROOT / "examples" / "simulate.py"), run_name="__main__")
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "| A / B | 2.00x | 3.00x | 4.00x | 3.00x | 2.00-4.00x | 2-4x higher | yes |" in out
    assert "| A / C | - | 0.50x | - | 0.50x | 0.50-0.50x | (not run by the paper) | no |" in out
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["out-seed0.json", "out-seed1.json", "out-seed2.json"]


def test_all_workload_is_fixed_and_priority_protects_online_work():
    """The `all` workload (one trace for every policy) at CI scale, under fcfs and priority; the
    whole experiment, every policy, runs from examples/simulate.py (BROS is slow in its bursts)."""
    from experiments import mixed
    from nanoserve.sim.metrics import summarize
    from nanoserve.sim.simulation import simulate
    trace, rate, batch = mixed.workload("ci", 0)
    assert (trace, rate, batch) == mixed.workload("ci", 0)  # seeded: the same for every policy
    assert {r.priority for r in trace} == {"online", "offline"} and rate > 0 and batch > 0
    runs = {policy: summarize(simulate(mixed.config(policy, "ci"), trace)) for policy in ("fcfs", "priority")}
    # Serving online work first (vLLM++) must cut online tail latency against plain fcfs.
    assert runs["priority"]["online"].ttft_p99 * 2 < runs["fcfs"]["online"].ttft_p99
    assert runs["priority"]["all"].count == len(trace)


def test_all_runs_on_conserves_setup_host_memory_included():
    """`all` declares ConServe's setup: the same GPU and model, and the same host memory for
    swapped-out and checkpointed KV (left out, the policies with a host store got one the size
    of the device's KV, which BROS filled; RESULTS.md, issue 20)."""
    from experiments import conserve, mixed
    from nanoserve.sim.hardware import gpu
    from nanoserve.sim.models import model
    from nanoserve.sim.roofline import Roofline
    from nanoserve.sim.simulation import kv_blocks
    setup = conserve.SETUPS["paper"]
    assert (mixed.BASE.gpu, mixed.BASE.model) == (setup.gpu, setup.model)
    for policy in ("bros", "ecoserve", "conserve", "priority-nonselective"):
        assert mixed.config(policy, "ci").host_kv_tokens == setup.host_kv_tokens()
    device_tokens = kv_blocks(mixed.BASE, Roofline(gpu(setup.gpu), model(setup.model))) * mixed.BASE.block_size
    # 256 GB against ~17 GB of device KV at Llama-2-7B's 0.5 MB per token (32 layers x K, V x 4096 x fp16).
    assert setup.host_kv_tokens() == int(256e9 / (32 * 2 * 4096 * 2)) > 10 * device_tokens


def test_every_baseline_names_its_paper_sentence_and_a_registered_policy_and_manager():
    from nanoserve.memory import KV_MANAGER_NAMES
    from nanoserve.sched import SCHEDULERS
    from nanoserve.sim.simulation import SimConfig

    for label, baseline in BASELINES.items():
        assert baseline.policy in SCHEDULERS and baseline.kv_manager in KV_MANAGER_NAMES, label
        assert baseline.defined_by.startswith(("ours", "assumption")) or '"' in baseline.defined_by, label
        config = baseline.sim_config(SimConfig(model="OPT-13B"))
        assert (config.policy, config.kv_manager, config.model) == (baseline.policy, baseline.kv_manager, "OPT-13B")
    assert BASELINES[ORCA.label].sim_config(SimConfig()).max_num_seqs == 8
    assert "| vLLM (2023): prefill-first + swap | `prefill-first` | `swap` |" in markdown()


def test_ecoserve_sweep_resumes_from_its_saved_points(tmp_path, monkeypatch):
    """A sweep that writes its points and is started again reads them instead of simulating,
    and comes to the same comparisons; a sweep stopped part-way simulates only what is left."""
    points = tmp_path / "points.jsonl"
    first = ecoserve_experiment.run("ci", seed=0, requests=40, datasets=("alpaca",), points=points,
                                    ablation=False)
    lines = points.read_text().splitlines()
    assert len(lines) == len(first.extra["sweep"]) > len(ecoserve_experiment.SYSTEMS)

    def no_simulation(*args, **kwargs):
        raise AssertionError("a saved point was simulated again")

    monkeypatch.setattr(ecoserve_experiment, "simulate", no_simulation)
    again = ecoserve_experiment.run("ci", seed=0, requests=40, datasets=("alpaca",), points=points,
                                    ablation=False)
    assert [c.ours for c in again.comparisons] == [c.ours for c in first.comparisons]
    assert again.extra["sweep"] == first.extra["sweep"] and points.read_text().splitlines() == lines

    monkeypatch.undo()
    points.write_text("\n".join(lines[:3]) + "\n")  # stopped after three points
    calls = []
    original = ecoserve_experiment.simulate
    monkeypatch.setattr(ecoserve_experiment, "simulate", lambda *a, **k: calls.append(1) or original(*a, **k))
    resumed = ecoserve_experiment.run("ci", seed=0, requests=40, datasets=("alpaca",), points=points,
                                    ablation=False)
    assert len(calls) == len(lines) - 3
    assert [c.ours for c in resumed.comparisons] == [c.ours for c in first.comparisons]


def test_progress_counts_points_and_simulated_seconds(monkeypatch, capsys):
    from experiments.progress import Progress

    monkeypatch.setenv("NANOSERVE_PROGRESS", "1")  # drawn even though stderr is captured
    progress = Progress(total=3, label="sweep")
    progress.done(120.0)
    progress.done()  # a point read back from a saved file: no simulated time
    assert progress.simulated == 120.0
    progress.close()
    assert "sweep" in capsys.readouterr().err
    monkeypatch.setenv("NANOSERVE_PROGRESS", "0")
    quiet = Progress(total=1, label="quiet")
    quiet.done(1.0)
    quiet.close()
    assert "quiet" not in capsys.readouterr().err


def test_ecoserve_fig11_plot_reads_saved_points(tmp_path):
    """`python -m experiments.ecoserve_fig11` draws Fig. 11's ablation from points files alone:
    each variant's JCT against vLLM (2023)'s at the chosen rate, flat pricing only."""
    from experiments import ecoserve_fig11

    def point(system, rate, jct, pricing="flat"):
        key = f"ShareGPT|{system}|{rate}|seed 0|10 requests|v2|Fig. 11 {pricing}"
        return json.dumps({"key": key, "row": {"system": system, "rate": rate, "jct_mean": jct}})

    lines = [point(VLLM_2023.label, 2.0, 10.0), point("EcoServe-D", 2.0, 15.0), point("EcoServe", 2.0, 5.0),
             point("EcoServe", 2.0, 99.0, pricing="measured"), point("EcoServe", 3.0, 99.0)]
    points = tmp_path / "seed0.jsonl"
    points.write_text("\n".join(lines) + "\n")
    assert ecoserve_fig11.jct_changes(points, 2.0) == {"EcoServe-D": 0.5, "EcoServe": -0.5}
    with pytest.raises(ValueError, match="no Fig. 11 point"):
        ecoserve_fig11.jct_changes(points, 5.0)
    out = ecoserve_fig11.plot([points, points], 2.0, tmp_path / "fig11.png")
    assert out.stat().st_size > 1000 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bros_ablation_plot_reads_saved_points(tmp_path):
    """`python -m experiments.bros_ablation` draws §4.2's ablation from points files alone: each
    variant's RT normalized latency over the default's."""
    from experiments import bros_ablation

    def point(label, latency):
        return json.dumps({"key": f"Fig. 10(a)|BROS|20.5|seed 0|600 s|{label}|v1", "row": {"rt_norm_latency": latency}})

    points = tmp_path / "seed0.jsonl"
    points.write_text("\n".join([point("Fig. 10", 9.0), point(bros_ablation.DEFAULT, 2.0),
                                 point("§4.2 B0=8, +1", 4.0), point("§4.2 prefill whole (the paper's)", 2.0)]) + "\n")
    assert bros_ablation.latency_ratios(points) == {"§4.2 B0=8, +1": 2.0, "§4.2 prefill whole (the paper's)": 1.0}
    empty = tmp_path / "empty.jsonl"
    empty.write_text(point("§4.2 B0=8, +1", 4.0) + "\n")
    with pytest.raises(ValueError, match="no '§4.2 B0=8, x2' point"):
        bros_ablation.latency_ratios(empty)
    out = bros_ablation.plot([points], tmp_path / "ablation.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_kunserve_fig14_plot_reads_saved_tables(tmp_path):
    """`python -m experiments.kunserve_fig14` draws Fig. 14's ablation from the saved Markdown
    tables alone, bubbles only for the variants that ran pipelines."""
    from experiments import kunserve_fig14

    table = tmp_path / "fig14-seed0.txt"
    table.write_text("| dataset | variant | ttft_p99 | bubble_ratio |\n|---|---|---|---|\n"
                     "| LongBench | vLLM (DP) | 381.7 | None |\n"
                     "| LongBench | + Dynamic drop, token-count micro-batches (Fig. 17 (a)) | 116.8 | 0.3119 |\n"
                     "\nwall 63\n")
    rows = kunserve_fig14.read_table(table)
    assert [r["variant"] for r in rows] == ["vLLM (DP)", "+ Dynamic drop, token-count micro-batches (Fig. 17 (a))"]
    assert rows[1]["bubble_ratio"] == "0.3119"
    empty = tmp_path / "empty.txt"
    empty.write_text("no table here\n")
    with pytest.raises(ValueError, match="no Markdown table"):
        kunserve_fig14.read_table(empty)
    out = kunserve_fig14.plot([table, table], tmp_path / "fig14.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
