"""The regime arithmetic of experiments/kunserve_regime.py: Little's law and the
decode-in-what-prefills-leave model hold together, and §2.2's numbers read back as the paper
states them."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments import kunserve_regime as regime
from experiments.kunserve import DATASETS, GPU, MODEL, kv_tokens_per_gpu
from nanoserve.sim.hardware import gpu
from nanoserve.sim.models import model
from nanoserve.sim.roofline import Roofline
from nanoserve.sim.workloads import LENGTHS

ROOF = Roofline(gpu(GPU), model(MODEL))


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(list(DATASETS.values())), st.floats(0.05, 1.0))
def test_steady_state_is_a_fixed_point_of_little_s_law(lengths, share):
    s = regime.steady_state(ROOF, kv_tokens_per_gpu(), lengths, share)
    assert s.resident * (lengths.mean_prompt + lengths.mean_output / 2) == pytest.approx(share * kv_tokens_per_gpu())
    assert s.rate * s.stay_s == pytest.approx(s.resident)  # Little's law
    prefill = regime.prefill_seconds(ROOF, lengths)
    assert s.prefill_share == pytest.approx(s.rate * prefill) and 0 < s.prefill_share < 1
    # Per second: the prefills' time plus the decode steps that give every resident request
    # its tokens (rate x output tokens, N per step) fill the GPU exactly.
    steps = s.rate * lengths.mean_output / s.resident
    assert s.prefill_share + steps * s.decode_step_s == pytest.approx(1.0)
    assert s.tpot_s > ROOF.iteration_seconds([(round(lengths.mean_prompt), 1)]) * 0.99  # never faster than alone


def test_more_kv_held_needs_a_higher_rate_and_a_slower_tpot():
    lengths = LENGTHS["longbench"]
    low, high = (regime.steady_state(ROOF, kv_tokens_per_gpu(), lengths, share) for share in (0.3, 0.6))
    assert high.rate > low.rate and high.tpot_s > low.tpot_s and high.prefill_share > low.prefill_share


def test_paper_point_reads_section_2_2_back():
    point = regime.paper_point(ROOF, kv_tokens_per_gpu(), LENGTHS["burstgpt"])
    assert ROOF.cost.kv_bytes_per_token == regime.PAPER_KIB_PER_TOKEN * 1024  # "192 KB" per token
    assert point.burst_gb == pytest.approx(243_000 * 192 * 1024 / 1e9)
    assert point.held_tokens * regime.PAPER_PROVISIONING == pytest.approx(kv_tokens_per_gpu())
    assert point.rate * regime.PAPER_STAY_S * (642 + 262 / 2) == pytest.approx(point.held_tokens)


def test_bad_share_is_refused():
    with pytest.raises(ValueError):
        regime.steady_state(ROOF, kv_tokens_per_gpu(), LENGTHS["burstgpt"], 0.0)
