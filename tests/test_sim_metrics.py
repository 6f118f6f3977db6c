"""sim/metrics.py: percentiles, per-class summaries, SLO attainment, throughput, KV usage, and
the table / JSON / plot outputs, on hand-built SimResults plus one real simulated run."""
from __future__ import annotations

import json
import math
import statistics

import pytest

from nanoserve.sim.metrics import (
    Summary,
    downsample,
    kv_usage_summary,
    markdown_table,
    percentile,
    plot,
    slugify,
    summarize,
    to_json,
)
from nanoserve.sim.simulation import RequestRecord, SimConfig, SimResult, simulate
from nanoserve.sim.workloads import TraceRequest
from nanoserve.slo import SLO

CONFIG = SimConfig(policy="fcfs", online_slo=SLO(ttft=1.0, tpot=0.1), offline_slo=SLO(ttft=10.0, tpot=1.0))


def record(i: int, priority: str, ttft: float, tpot: float | None, e2e: float, output_len: int,
           preemptions: int = 0, arrival: float = 0.0) -> RequestRecord:
    return RequestRecord(f"r{i}", priority, arrival, 100, output_len, ttft, tpot, e2e, preemptions, "stop")


def make_result(records: list[RequestRecord], duration: float = 10.0,
                kv_usage: list[tuple[float, float]] | None = None, config: SimConfig = CONFIG) -> SimResult:
    return SimResult(config, records, kv_usage or [(0.0, 0.1), (1.0, 0.5)], {"preemptions": 1}, steps=42,
                     busy_seconds=8.0, link_busy_seconds=0.5, forward_stall_seconds=0.25, duration=duration)


RECORDS = [
    record(0, "online", 0.5, 0.05, 1.0, 10, arrival=0.0),               # meets both targets
    record(1, "online", 2.0, 0.05, 3.0, 20, preemptions=2, arrival=1.0),  # misses TTFT (1 s)
    record(2, "online", 0.2, 0.30, 4.0, 10, arrival=2.0),               # misses TPOT (0.1 s)
    record(3, "online", 0.9, None, 0.9, 1, arrival=3.0),                # 1-token output: no TPOT, meets
    record(4, "offline", 5.0, 0.50, 20.0, 40, arrival=4.0),             # meets the offline SLO
    record(5, "offline", 12.0, 0.20, 30.0, 30, preemptions=1, arrival=5.0),  # misses the offline TTFT
]


# ----------------------------------------------------------------------------- percentile
def test_percentile_hand_values() -> None:
    values = [4.0, 1.0, 3.0, 2.0]  # sorted: 1 2 3 4; position q/100 * 3
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 90) == pytest.approx(3.7)   # 2.7 -> 3 + 0.7 * (4 - 3)
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile([7.0], 99) == 7.0


def test_percentile_matches_statistics_quantiles() -> None:
    data = [0.3, 1.7, 2.2, 2.2, 5.0, 8.1, 9.4, 13.0, 21.5, 34.0, 0.01]
    cuts = statistics.quantiles(data, n=100, method="inclusive")  # linear, like numpy's default
    for q in (1, 10, 25, 50, 75, 90, 99):
        assert percentile(data, q) == pytest.approx(cuts[q - 1])


def test_percentile_ignores_none_and_rejects_empty() -> None:
    assert percentile([None, 2.0, None, 4.0], 50) == pytest.approx(3.0)
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([None, None], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


# ----------------------------------------------------------------------------- summaries
def test_summarize_splits_classes() -> None:
    summaries = summarize(make_result(RECORDS))
    assert set(summaries) == {"all", "online", "offline"}
    assert [summaries[c].count for c in ("all", "online", "offline")] == [6, 4, 2]
    online = summaries["online"]
    assert (online.policy, online.gpu, online.model, online.request_class) == ("fcfs", "A100-80G", "Llama-2-7B",
                                                                             "online")
    assert online.ttft_p50 == pytest.approx(percentile([0.5, 2.0, 0.2, 0.9], 50))
    assert online.tpot_p99 == pytest.approx(percentile([0.05, 0.05, 0.30], 99))  # None skipped
    assert online.preemptions == 2 and summaries["offline"].preemptions == 1 and summaries["all"].preemptions == 3
    assert summaries["offline"].e2e_p50 == pytest.approx(25.0)


def test_summarize_omits_empty_classes() -> None:
    summaries = summarize(make_result(RECORDS[:4]))
    assert set(summaries) == {"all", "online"}


def test_tpot_none_when_no_request_has_one() -> None:
    s = summarize(make_result([record(0, "online", 0.1, None, 0.1, 1)]))["all"]
    assert s.tpot_p50 is None and s.tpot_p99 is None and s.ttft_p50 == pytest.approx(0.1)


def test_normalized_latency() -> None:
    s = summarize(make_result(RECORDS))["online"]
    norm = [1.0 / 10, 3.0 / 20, 4.0 / 10, 0.9 / 1]  # e2e / output_len
    assert s.norm_latency_mean == pytest.approx(sum(norm) / 4)
    assert s.norm_latency_p50 == pytest.approx(percentile(norm, 50))
    assert s.norm_latency_p99 == pytest.approx(percentile(norm, 99))


def test_slo_attainment() -> None:
    summaries = summarize(make_result(RECORDS))
    assert summaries["online"].slo_attainment == pytest.approx(2 / 4)  # r0, r3 meet; r1 TTFT, r2 TPOT miss
    assert summaries["offline"].slo_attainment == pytest.approx(1 / 2)
    assert summaries["all"].slo_attainment == pytest.approx(3 / 6)  # each request held to its own class's SLO


def test_slo_attainment_default_offline_has_no_targets() -> None:
    s = summarize(make_result(RECORDS[4:], config=SimConfig()))["offline"]
    assert s.slo_attainment == 1.0


def test_throughput() -> None:
    summaries = summarize(make_result(RECORDS, duration=10.0))
    assert summaries["all"].output_tokens == 111
    assert summaries["all"].throughput_tok_s == pytest.approx(11.1)
    assert summaries["all"].throughput_req_s == pytest.approx(0.6)
    assert summaries["online"].throughput_tok_s == pytest.approx(4.1)
    assert (summaries["online"].throughput_tok_s + summaries["offline"].throughput_tok_s
            == pytest.approx(summaries["all"].throughput_tok_s))


# ----------------------------------------------------------------------------- KV usage
def test_kv_usage_summary_time_weighted() -> None:
    # 0.2 for 1 s, 0.8 for 3 s, 0.4 for 0 s: the mean weighs by time (0.2 + 2.4) / 4 = 0.65,
    # where a plain mean of the samples would give 0.467.
    series = [(10.0, 0.2), (11.0, 0.8), (14.0, 0.4)]
    kv = kv_usage_summary(make_result(RECORDS, kv_usage=series))
    assert kv["mean"] == pytest.approx(0.65)
    assert kv["peak"] == pytest.approx(0.8)


def test_kv_usage_summary_degenerate() -> None:
    result = make_result(RECORDS)
    result.kv_usage = []
    assert kv_usage_summary(result) == {"mean": 0.0, "peak": 0.0}
    result.kv_usage = [(1.0, 0.3), (1.0, 0.5)]
    assert kv_usage_summary(result)["mean"] == pytest.approx(0.4)


def test_downsample() -> None:
    series = [(float(i), i / 2000) for i in range(2000)]
    small = downsample(series, 500)
    assert len(small) == 500 and small[0] == series[0] and small[-1] == series[-1]
    assert downsample(series[:10], 500) == series[:10]


# ----------------------------------------------------------------------------- outputs
def test_markdown_table() -> None:
    s = summarize(make_result(RECORDS))
    table = markdown_table([("fcfs baseline", s["all"]), ("fcfs|online", s["online"])],
                           workload="ShareGPT-like (synthetic)")
    lines = table.strip().splitlines()
    assert lines[0].startswith("| label | class | requests | TTFT p50 (ms)")
    assert lines[1].count("---") == 10
    assert "fcfs baseline" in table and "fcfs\\|online" in table  # pipes escaped
    assert "| 11.1 |" in table  # throughput tok/s
    assert "50.0%" in table  # SLO attainment
    assert f"{s['online'].ttft_p50 * 1e3:.1f}" in table
    assert "synthetic" in lines[-1]
    with pytest.raises(ValueError):
        markdown_table([("x", s["all"])], columns=["nope"])
    custom = markdown_table([("x", s["all"])], columns=["policy", "preemptions", "throughput_req_s"])
    assert "| fcfs | 3 | 0.60 |" in custom


def test_markdown_table_missing_tpot() -> None:
    s = summarize(make_result([record(0, "online", 0.1, None, 0.1, 1)]))["all"]
    assert "| - | - |" in markdown_table([("one-token", s)])


def test_to_json_round_trip(tmp_path) -> None:
    results = {"fcfs": make_result(RECORDS, kv_usage=[(i * 0.01, (i % 7) / 7) for i in range(2000)]),
               "online-only": make_result(RECORDS[:4])}
    path = tmp_path / "out" / "run.json"
    returned = to_json(results, path, workload="ShareGPT-like (synthetic)", extra={"seed": 0})
    data = json.loads(path.read_text())
    assert data == returned
    assert data["workload_note"] == "ShareGPT-like (synthetic)" and data["extra"] == {"seed": 0}
    run = data["results"]["fcfs"]
    assert run["config"]["policy"] == "fcfs"
    assert run["config"]["online_slo"] == {"ttft": 1.0, "tpot": 0.1, "jct_fixed": None, "jct_per_token": None}
    assert run["summaries"]["online"]["count"] == 4 and run["summaries"]["all"]["slo_attainment"] == 0.5
    assert run["events"] == {"preemptions": 1} and run["steps"] == 42
    assert run["busy_seconds"] == 8.0 and run["duration"] == 10.0
    assert run["link_busy_seconds"] == 0.5 and run["forward_stall_seconds"] == 0.25
    assert run["config"]["calibrate_cost_model"] is True
    assert len(run["kv_usage"]) <= 500 and run["kv_usage"][-1] == pytest.approx([19.99, 4 / 7])
    assert set(data["results"]["online-only"]["summaries"]) == {"all", "online"}
    assert data["results"]["online-only"]["summaries"]["all"]["tpot_p50"] == pytest.approx(0.05)
    with pytest.raises(TypeError):
        to_json(results, tmp_path / "x.json")  # the workload note is required


def test_to_json_nonfinite_becomes_null(tmp_path) -> None:
    data = to_json({"zero": make_result(RECORDS, duration=0.0)}, tmp_path / "z.json", workload="synthetic")
    assert data["results"]["zero"]["summaries"]["all"]["throughput_tok_s"] is None


def test_plot_writes_three_pngs(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    results = {"fcfs": make_result(RECORDS, kv_usage=[(0.0, 0.1), (1.0, 0.6), (2.0, 0.3)]),
               "other": make_result(RECORDS[:3])}
    paths = plot(results, tmp_path / "plots", "FCFS vs other: A100", workload="ShareGPT-like (synthetic)")
    assert len(paths) == 3 and len(set(paths)) == 3
    for path in paths:
        assert path.exists() and path.stat().st_size > 1000
        assert path.name.startswith("fcfs-vs-other-a100-") and path.suffix == ".png"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_slugify() -> None:
    assert slugify("EcoServe: Llama-2-7B @ 4 req/s") == "ecoserve-llama-2-7b-4-req-s"
    assert slugify("!!!") == "sim"


# ----------------------------------------------------------------------------- end to end
def test_summarize_real_simulation() -> None:
    trace = [TraceRequest(0.0, 64, 8), TraceRequest(0.05, 128, 1), TraceRequest(0.1, 32, 16, "offline"),
             TraceRequest(0.2, 256, 4), TraceRequest(0.3, 16, 24, "offline")]
    result = simulate(SimConfig(policy="fcfs"), trace)
    summaries = summarize(result)
    assert [summaries[c].count for c in ("all", "online", "offline")] == [5, 3, 2]
    assert summaries["all"].output_tokens == sum(r.output_len for r in trace)
    for s in summaries.values():
        assert isinstance(s, Summary)
        for name, value in vars(s).items():
            if isinstance(value, float):
                assert math.isfinite(value) and value >= 0, name
        assert 0 <= s.slo_attainment <= 1
    assert summaries["all"].throughput_tok_s == pytest.approx(53 / result.duration)
    kv = kv_usage_summary(result)
    assert 0 < kv["mean"] <= kv["peak"] <= 1


def test_horizon_cuts_the_run_and_unfinished_requests_count_as_waiting_misses() -> None:
    # 40 requests of 200 output tokens at once: far more than 2 virtual seconds of work.
    trace = [TraceRequest(0.0, 64, 200) for _ in range(40)]
    full = simulate(CONFIG, trace)
    cut = simulate(SimConfig(policy="fcfs", online_slo=CONFIG.online_slo, horizon=2.0), trace)
    assert full.unfinished == 0 and 0 < cut.unfinished <= len(trace)
    assert 2.0 <= cut.duration < full.duration and cut.steps < full.steps
    left = [r for r in cut.records if r.e2e is None]
    assert all(r.finish_reason is None and r.tpot is None for r in left)
    online = summarize(cut)["online"]
    assert online.unfinished == cut.unfinished and online.count == len(trace)
    # Each unfinished request counts as an SLO miss and with at least the time it had waited.
    assert online.slo_attainment <= 1 - cut.unfinished / len(trace)
    assert online.e2e_p99 >= cut.duration - 1e-9
    assert online.output_tokens == sum(r.output_len for r in cut.records if r.e2e is not None)
