"""Response-length predictors (nanoserve/memory/predictor.py, ecoserve.txt §2.3, §3.2): the oracle,
the online bucket-quantile predictor on synthetic lognormal workloads, EcoServe's accuracy
arithmetic, and a predictor plugged into the exact KV manager and consulted on admission."""
from __future__ import annotations

import dataclasses
import math
import random
from statistics import NormalDist

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.config import SchedulerConfig
from nanoserve.memory import KVBuildContext, make_kv_manager
from nanoserve.memory.exact_kv import build
from nanoserve.memory.host import HostKVStore
from nanoserve.memory.predictor import (
    PAPER_PREDICTION_ERROR,
    BucketQuantileConfig,
    BucketQuantilePredictor,
    LengthPredictor,
    NoisyOraclePredictor,
    OraclePredictor,
    PredictionError,
    PredictorAccuracy,
    prompt_bucket,
    quantile,
)
from nanoserve.request import Request, RequestStatus
from nanoserve.sampling import SamplingParams
from nanoserve.sched.fcfs import FCFSScheduler
from nanoserve.sim.workloads import LENGTHS

_ids = iter(range(10**9))


def _request(prompt_len: int = 4, max_tokens: int = 4096, rid: str | None = None) -> Request:
    return Request(rid or f"r{next(_ids)}", [1] * prompt_len, SamplingParams(max_tokens=max_tokens))


# -- noisy oracle: the paper's predictor's accuracy (§2.3) --------------------------------------
@pytest.mark.parametrize("dataset", sorted(PAPER_PREDICTION_ERROR))
def test_noisy_oracle_has_the_papers_accuracy_and_splits_its_misses(dataset):
    error = PAPER_PREDICTION_ERROR[dataset]
    pairs = LENGTHS["sharegpt-ecoserve"].sample(8000, seed=5)
    lengths = {f"n{i}": out for i, (_, out) in enumerate(pairs)}
    predictor = NoisyOraclePredictor(lengths, error, seed=1)
    accuracy = PredictorAccuracy(error.padding)
    for i, (prompt, out) in enumerate(pairs):
        accuracy.record(predictor(_request(prompt, rid=f"n{i}")), out)
    assert accuracy.accuracy == pytest.approx(error.accuracy, abs=0.015)
    misses = 1 - accuracy.accuracy
    assert accuracy.under_predicted == pytest.approx(misses * error.under_share, abs=0.015)


def test_noisy_oracle_is_deterministic_per_seed_and_request_and_honours_its_extremes():
    lengths = {f"d{i}": 10 + 7 * i for i in range(300)}
    a, b = NoisyOraclePredictor(lengths, seed=4), NoisyOraclePredictor(lengths, seed=4)
    requests = [_request(rid=f"d{i}") for i in range(300)]
    assert [a(r) for r in requests] == [b(r) for r in requests] == [a(r) for r in requests]
    assert [a(r) for r in requests] != [NoisyOraclePredictor(lengths, seed=5)(r) for r in requests]
    exact = NoisyOraclePredictor(lengths, PredictionError(accuracy=1.0, padding=0.0))
    assert [exact(r) for r in requests] == [lengths[r.request_id] for r in requests]
    for under_share, expected in ((1.0, 1.0), (0.0, 0.0)):  # always under, always over
        predictor = NoisyOraclePredictor(lengths, PredictionError(accuracy=0.0, under_share=under_share))
        accuracy = PredictorAccuracy(0.15)
        for r in requests:
            accuracy.record(predictor(r), lengths[r.request_id])
        assert accuracy.accuracy == 0 and accuracy.under_predicted == expected
    assert a(_request(rid="unknown", max_tokens=77)) == 77
    with pytest.raises(ValueError):
        PredictionError(accuracy=1.5)


def test_remaining_length_is_re_predicted_conditional_on_what_was_generated():
    request = _request(8, max_tokens=1000, rid="rem")
    for token in range(300):
        request.append_token(token, 0.0)
    assert OraclePredictor({"rem": 420}).predict_remaining(request) == 120
    assert OraclePredictor({"rem": 250}).predict_remaining(request) == 1  # overran the truth: at least one
    # Bucket quantile: the median of the lengths beyond 300 (400, 500, 600, ...), minus 300.
    learned = BucketQuantilePredictor().warm([(8, 100)] * 20 + [(8, n) for n in range(400, 1300, 100)])
    assert learned.predict(request) == 100  # the plain median: already outrun
    assert learned.predict_remaining(request) == 800 - 300
    assert BucketQuantilePredictor().predict_remaining(request) == 1000 - 300  # no history: max_tokens
    noisy = NoisyOraclePredictor({"rem": 420}, PredictionError(accuracy=1.0, padding=0.0))
    assert noisy.predict_remaining(request) == 120


def test_warm_start_learns_held_out_pairs_before_any_request_finishes():
    cold = BucketQuantilePredictor()
    assert cold.predict(_request(8, max_tokens=900)) == 900  # no history: max_tokens
    warm = BucketQuantilePredictor().warm([(8, 40)] * 5 + [(8, 60)] * 5 + [(1000, 500)] * 10)
    assert warm.predict(_request(8, max_tokens=900)) == 40  # its bucket's median
    assert warm.predict(_request(1000, max_tokens=900)) == 500
    assert warm.num_stored == 40


# -- oracle -------------------------------------------------------------------------------------
def test_oracle_returns_the_truth_clamped_and_max_tokens_for_unknown_ids():
    oracle = OraclePredictor({"a": 37, "b": 500, "c": 0})
    assert oracle.predict(_request(rid="a", max_tokens=100)) == 37
    assert oracle(_request(rid="a", max_tokens=100)) == 37  # callable: exact_kv's predicted_len
    assert oracle.predict(_request(rid="b", max_tokens=100)) == 100  # never past max_tokens
    assert oracle.predict(_request(rid="c", max_tokens=100)) == 1  # never below 1
    assert oracle.predict(_request(rid="zzz", max_tokens=64)) == 64  # unknown: max_tokens
    oracle.observe(_request(rid="a"), 12)  # stateless: learning changes nothing
    assert oracle.predict(_request(rid="a", max_tokens=100)) == 37


# -- bucket quantile ----------------------------------------------------------------------------
def test_prompt_buckets_are_log2_and_quantiles_are_nearest_rank():
    assert [prompt_bucket(n) for n in (1, 2, 3, 4, 7, 8, 1023, 1024)] == [1, 2, 2, 3, 3, 4, 10, 11]
    assert quantile([5, 1, 4, 2, 3], 0.5) == 3 and quantile([5, 1, 4, 2, 3], 1.0) == 5
    assert quantile([10, 20, 30, 40], 0.5) == 20 and quantile([10, 20, 30, 40], 0.75) == 30
    assert quantile([7], 0.01) == 7


# Short prompts (8-15 tokens) get short answers, long ones (512-1023) long answers: two
# lognormal RL distributions, (mu, sigma) of the log length.
WORKLOAD = {(8, 16): (3.0, 0.5), (512, 1024): (5.5, 0.4)}


def _draw(rng: random.Random, mu: float, sigma: float) -> int:
    return max(1, round(rng.lognormvariate(mu, sigma)))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("q", [0.5, 0.75, 0.9])
def test_bucket_predictor_converges_to_each_buckets_quantile(seed, q):
    rng = random.Random(seed)
    predictor = BucketQuantilePredictor(BucketQuantileConfig(quantile=q, window=512))
    for _ in range(3000):
        (lo, hi), (mu, sigma) = rng.choice(list(WORKLOAD.items()))
        predictor.observe(_request(rng.randrange(lo, hi)), _draw(rng, mu, sigma))
    predictions = {}
    for (lo, hi), (mu, sigma) in WORKLOAD.items():
        expected = math.exp(mu + sigma * NormalDist().inv_cdf(q))  # the lognormal's q-quantile
        predictions[lo] = got = predictor.predict(_request(rng.randrange(lo, hi)))
        # 512 samples put the quantile within a few percent; rounding adds up to 0.5 token.
        assert abs(got - expected) <= 0.12 * expected + 1, (lo, q, got, expected)
    # The buckets are kept apart: the global window's quantile would sit between them.
    assert predictions[512] > 5 * predictions[8]


def test_fallbacks_bucket_then_global_window_then_default_or_max_tokens():
    predictor = BucketQuantilePredictor(BucketQuantileConfig(min_samples=4))
    assert predictor.predict(_request(8, max_tokens=300)) == 300  # no history: max_tokens
    assert BucketQuantilePredictor(BucketQuantileConfig(default=50)).predict(_request(8, max_tokens=300)) == 50
    for length in (10, 20, 30):
        predictor.observe(_request(8), length)
    assert predictor.predict(_request(8, max_tokens=300)) == 300  # 3 < min_samples, even globally
    predictor.observe(_request(8), 40)
    assert predictor.predict(_request(8)) == 20  # the bucket's median
    assert predictor.predict(_request(900)) == 20  # empty bucket: the global window's median
    for _ in range(4):
        predictor.observe(_request(900), 400)
    assert predictor.predict(_request(900)) == 400  # its own bucket now has enough
    assert predictor.predict(_request(8)) == 20  # and does not leak into the short one


def test_observe_defaults_to_the_requests_output_and_skips_aborted_requests():
    predictor = BucketQuantilePredictor(BucketQuantileConfig(min_samples=1))
    done = _request(8)
    for token in (5, 6, 7):
        done.append_token(token, 0.0)
    done.status = RequestStatus.FINISHED_STOPPED
    predictor.observe(done)
    aborted = _request(8)
    aborted.append_token(5, 0.0)
    aborted.status = RequestStatus.FINISHED_ABORTED
    predictor.observe(aborted)
    assert predictor.num_stored == 2 and predictor.predict(_request(8)) == 3  # one sample, in two windows
    with pytest.raises(ValueError):
        predictor.observe(_request(8), -1)


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(1, 5000), st.integers(0, 10_000)), max_size=60),
       prompt_len=st.integers(1, 5000), max_tokens=st.integers(1, 2048),
       q=st.floats(0.01, 1.0), default=st.none() | st.integers(1, 10_000))
def test_predictions_are_at_least_one_and_at_most_max_tokens(lengths, prompt_len, max_tokens, q, default):
    predictor = BucketQuantilePredictor(BucketQuantileConfig(quantile=q, min_samples=3, default=default))
    for p, n in lengths:
        predictor.observe(_request(p), n)
    assert 1 <= predictor.predict(_request(prompt_len, max_tokens)) <= max_tokens


def test_memory_is_bounded_and_the_window_follows_a_drifting_workload():
    cfg = BucketQuantileConfig(window=32, global_window=100, min_samples=8)
    predictor = BucketQuantilePredictor(cfg)
    rng = random.Random(0)
    for _ in range(20_000):
        predictor.observe(_request(rng.randrange(1, 4096)), rng.randrange(1, 1000))
    assert all(len(w) <= cfg.window for w in predictor.buckets.values())
    assert len(predictor.buckets) <= 12  # log2 buckets of prompts below 4096
    assert predictor.num_stored <= cfg.global_window + len(predictor.buckets) * cfg.window
    for _ in range(cfg.window):  # the workload shifts: only the newest lengths count
        predictor.observe(_request(100), 7)
    assert predictor.predict(_request(100)) == 7


def test_config_is_frozen_and_validated():
    cfg = BucketQuantileConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.quantile = 0.9  # type: ignore[misc]
    for bad in (dict(quantile=0.0), dict(quantile=1.5), dict(window=0), dict(min_samples=0), dict(default=0)):
        with pytest.raises(ValueError):
            BucketQuantileConfig(**bad)


# -- accuracy -----------------------------------------------------------------------------------
def test_accuracy_counts_true_lengths_within_plus_minus_padding():
    acc = PredictorAccuracy(padding=0.1)
    cases = [  # (predicted, true, within ±10%, under the padded reservation)
        (100, 100, True, False), (100, 110, True, False), (100, 111, False, True),
        (100, 90, True, False), (100, 89, False, False),  # an over-prediction: waste, not overrun
        (15, 17, True, False),  # the padding rounds up, as the allocator reserves it: ceil(1.5) = 2
        (20, 22, True, False), (20, 23, False, True),  # 20 * 0.1 is 2.0000000000000004: still 2
    ]
    for predicted, true, _, _ in cases:
        acc.record(predicted, true)
    assert acc.count == len(cases)
    assert acc.accuracy == pytest.approx(sum(c[2] for c in cases) / len(cases))  # 5 / 8
    assert acc.under_predicted == pytest.approx(2 / 8)
    assert acc.mean_abs_error == pytest.approx((0 + 10 + 11 + 10 + 11 + 2 + 2 + 3) / 8)
    assert acc.summary() == {"count": 8, "accuracy": 5 / 8, "under_predicted": 2 / 8, "mean_abs_error": 49 / 8}


def test_accuracy_without_padding_is_exact_matches_and_empty_is_zero():
    empty = PredictorAccuracy()
    assert (empty.accuracy, empty.under_predicted, empty.mean_abs_error) == (0.0, 0.0, 0.0)
    acc = PredictorAccuracy(padding=0.0)
    for predicted, true in ((10, 10), (10, 11), (10, 9), (1, 1)):
        acc.record(predicted, true)
    assert (acc.accuracy, acc.under_predicted, acc.mean_abs_error) == (0.5, 0.25, 0.5)
    with pytest.raises(ValueError):
        PredictorAccuracy(padding=-0.1)


# -- plugged into exact allocation --------------------------------------------------------------
BLOCK = 4


class SpyPredictor(LengthPredictor):
    """A fixed prediction, counting how often the KV manager asks."""

    def __init__(self, length: int):
        self.length, self.calls = length, []

    def predict(self, request: Request) -> int:
        self.calls.append(request.request_id)
        return self.length


def _exact(predictor: LengthPredictor, num_blocks: int = 32):
    store = HostKVStore(0, BLOCK, 1, 1, 2, torch.float32, pin_memory=False)
    ctx = KVBuildContext(num_blocks, BLOCK, None, store,  # type: ignore[arg-type]
                         {"predicted_len": predictor, "padding_ratio": 0.0, "reserved_fraction": 0.0,
                          "long_prompts": "coupled"})  # no pool: every prompt spills with its RL
    return build(ctx)


def test_a_predictor_instance_is_exact_kvs_predicted_len_and_is_asked_once_on_admission():
    spy = SpyPredictor(6)
    kv = _exact(spy)
    request = _request(4, max_tokens=100, rid="a")
    assert kv.can_reserve(request, 4) and spy.calls == ["a"]
    kv.reserve(request, 4)
    assert spy.calls == ["a"]  # cached: can_reserve and reserve agree
    assert kv.num_used_blocks == math.ceil((4 + 6) / BLOCK)  # prompt + predicted RL, exactly
    kv.release(request)
    assert kv.num_used_blocks == 0


def test_a_learned_prediction_sizes_admission_through_the_fcfs_scheduler():
    predictor = BucketQuantilePredictor(BucketQuantileConfig(min_samples=3))
    for length in (9, 10, 11, 12, 30):  # short prompts have answered in about 11 tokens
        predictor.observe(_request(5), length)
    kv = make_kv_manager("exact", KVBuildContext(
        32, BLOCK, None, HostKVStore(0, BLOCK, 1, 1, 2, torch.float32, pin_memory=False),  # type: ignore[arg-type]
        {"predicted_len": predictor, "padding_ratio": 0.0, "reserved_fraction": 0.0, "decoupled": False}))
    scheduler = FCFSScheduler(SchedulerConfig(), kv)  # coupled: fcfs does not batch GTs itself
    request = _request(5, max_tokens=200, rid="learned")
    scheduler.add_request(request)
    output = scheduler.schedule()
    assert [c.request.request_id for c in output.chunks] == ["learned"]
    assert kv.predicted_output_len(request) == 11  # the median, not max_tokens
    assert kv.num_used_blocks == math.ceil((5 + 11) / BLOCK)  # 4 blocks, not ceil(205 / 4) = 52
    # Without history the same request would reserve max_tokens, which this pool cannot hold.
    assert BucketQuantilePredictor().predict(request) == 200


def test_the_engine_teaches_an_online_predictor_through_exact_kv(tmp_path):
    """Finished requests reach `observe`: the predictor learns lengths from real serving."""
    from conftest import build_tiny_model

    from nanoserve import LLM

    build_tiny_model("llama", tmp_path)
    predictor = BucketQuantilePredictor(BucketQuantileConfig(min_samples=1))
    llm = LLM(str(tmp_path), device="cpu", kv_manager="exact", kv_cache_tokens=512, block_size=4,
              kv_manager_options={"predicted_len": predictor})
    llm.generate([[1, 2, 3], [4, 5, 6, 7]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                 use_tqdm=False)
    assert predictor.num_stored > 0
    assert predictor.predict(_request(prompt_len=3, max_tokens=50)) == 5
