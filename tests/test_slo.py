"""Latency targets per request class, and the per-class metrics the engine reports."""
from __future__ import annotations

import math

import pytest

from nanoserve import LLM, SLO, SamplingParams
from nanoserve.config import SchedulerConfig
from nanoserve.slo import DEFAULT_SLOS, ClassMetrics, percentile


@pytest.mark.parametrize("bad", [0, -1.0, math.inf, math.nan, "1s"])
def test_targets_must_be_positive_finite_seconds(bad):
    with pytest.raises(ValueError, match="positive number of seconds"):
        SLO(ttft=bad)


def test_attainment_needs_every_target_it_sets():
    slo = SLO(ttft=1.0, tpot=0.1)
    assert slo.attained(0.5, 0.05) and not slo.attained(1.5, 0.05) and not slo.attained(0.5, 0.2)
    assert slo.attained(0.5, None)  # a one-token answer has no TPOT to miss
    assert SLO().attained(100.0, 100.0)  # offline work has no targets by default


def test_a_jct_target_grows_with_the_output():
    # EcoServe §4: "the JCT SLO of a request [is] SLO-scale x (t_p + t_g x l_g)".
    slo = SLO(jct_fixed=0.2, jct_per_token=0.04)
    assert slo.jct_target(10) == pytest.approx(0.6) and SLO(ttft=1.0).jct_target(10) is None
    assert slo.attained(None, None, e2e=0.6, output_len=10) and not slo.attained(None, None, e2e=0.61, output_len=10)
    assert slo.attained(5.0, 5.0, e2e=1.0, output_len=100)  # no TTFT or TPOT target to miss
    assert slo.attained(None, None)  # no end-to-end measurement: nothing to miss
    with pytest.raises(ValueError, match="both"):
        SLO(jct_fixed=1.0)
    with pytest.raises(ValueError, match="positive"):
        SLO(jct_fixed=1.0, jct_per_token=0.0)
    metrics = ClassMetrics()
    metrics.observe(0.1, 0.01, 10, slo, arrival=0.0, now=0.7)  # 0.7 s > 0.6 s for 10 tokens
    metrics.observe(0.1, 0.01, 10, slo, arrival=1.0, now=1.5)
    assert metrics.summary()["slo_attainment"] == pytest.approx(0.5)


def test_percentile_and_class_summary():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.0 and percentile([3.0, 1.0, 2.0, 4.0], 99) == 4.0
    metrics = ClassMetrics(window=2)
    slo = SLO(ttft=1.0)
    for i, ttft in enumerate([0.5, 2.0, 0.7]):
        metrics.observe(ttft, 0.01, 10, slo, arrival=float(i), now=float(i) + 1.0)
    summary = metrics.summary()
    assert summary["finished"] == 3 and summary["slo_attainment"] == pytest.approx(2 / 3)
    assert list(metrics.ttfts) == [2.0, 0.7]  # the window keeps the latest samples
    assert summary["throughput_tok_s"] == pytest.approx(30 / 3.0)  # first arrival 0, last finish 3


def test_config_defaults_per_class():
    config = SchedulerConfig()
    assert config.slo_for("online") == DEFAULT_SLOS["online"] and config.slo_for("offline") == SLO()


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from conftest import build_tiny_model

    directory = tmp_path_factory.mktemp("llama")
    build_tiny_model("llama", directory)
    return LLM(str(directory), device="cpu", kv_cache_tokens=512, block_size=4)


def test_engine_reports_per_class_attainment(llm):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    before = llm.engine.stats().per_class
    llm.generate([[1, 2, 3], [4, 5, 6]], params, use_tqdm=False, priority=["online", "offline"],
                 slo=[SLO(ttft=1e-9), None])  # nothing answers within a nanosecond
    llm.generate([[7, 8]], params, use_tqdm=False, priority="online", slo=SLO(ttft=1e6, tpot=1e6))
    after = llm.engine.stats().per_class
    online, offline = after["online"], after["offline"]
    assert online["finished"] - before["online"]["finished"] == 2
    assert offline["finished"] - before["offline"]["finished"] == 1
    assert online["slo_attainment"] == pytest.approx(0.5)  # one missed, one met
    assert offline["slo_attainment"] == 1.0 and offline["ttft_p50"] > 0 and online["output_tokens"] >= 8


def test_requests_get_their_class_default_or_override(llm):
    engine = llm.engine
    params = SamplingParams(max_tokens=2)
    online = engine.add_request([1, 2], params, priority="online")
    offline = engine.add_request([3, 4], params, priority="offline")
    custom = engine.add_request([5, 6], params, priority="offline", slo=SLO(tpot=0.5))
    assert online.slo == engine.config.online_slo and offline.slo == SLO() and custom.slo == SLO(tpot=0.5)
    for request in (online, offline, custom):
        engine.abort_request(request.request_id)
    assert not engine.has_unfinished_requests()


def test_slo_list_must_match_the_prompts(llm):
    with pytest.raises(ValueError, match="2 SLOs for 1 prompts"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=2), use_tqdm=False, slo=[None, None])
