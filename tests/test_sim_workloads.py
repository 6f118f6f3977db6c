"""The simulator's workload generator (nanoserve/sim/workloads.py): arrival processes, the
papers' synthetic length distributions, and CSV traces."""
from __future__ import annotations

import bisect
import math
import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.sim.workloads import (
    BROS_BE,
    CONSERVE,
    LENGTHS,
    SHAREGPT_ECOSERVE,
    LengthDist,
    TraceRequest,
    burst_windows,
    bursty_arrivals,
    clipped_lognormal_mean,
    gamma_arrivals,
    make_trace,
    merge_traces,
    on_off_arrivals,
    poisson_arrivals,
    replay_csv,
    save_csv,
    solve_mu,
)


def _gaps(arrivals: list[float]) -> list[float]:
    return [b - a for a, b in zip([0.0] + arrivals, arrivals)]


def _mean_cv(xs: list[float]) -> tuple[float, float]:
    # Plain sums: statistics.stdev is exact-arithmetic and too slow for 10^5 samples.
    mean = math.fsum(xs) / len(xs)
    var = math.fsum((x - mean) ** 2 for x in xs) / (len(xs) - 1)
    return mean, math.sqrt(var) / mean


ARRIVALS = {
    "poisson": lambda **kw: poisson_arrivals(4.0, **kw),
    "gamma": lambda **kw: gamma_arrivals(4.0, 2.0, **kw),
    "on_off": lambda **kw: on_off_arrivals(4.0, 5.0, 3.0, **kw),
    "bursty": lambda **kw: bursty_arrivals(4.0, burst_every=20.0, burst_seconds=5.0, **kw),
}


@pytest.mark.parametrize("name", ARRIVALS)
def test_arrivals_deterministic_sorted_and_cut_by_n_or_duration(name):
    make = ARRIVALS[name]
    by_n = make(n=2000, seed=7)
    assert by_n == make(n=2000, seed=7)
    assert by_n != make(n=2000, seed=8)
    assert len(by_n) == 2000 and by_n == sorted(by_n) and by_n[0] >= 0

    by_time = make(duration=300.0, seed=7)
    assert by_time and by_time == sorted(by_time) and all(0 <= t < 300 for t in by_time)
    # n and duration cut the same underlying sequence.
    longer = make(n=len(by_time) + 1, seed=7)
    assert longer[:-1] == by_time and longer[-1] >= 300

    assert make(n=0) == [] and make(duration=0.0) == []


BAD_ARGS = [
    (poisson_arrivals, (0.0,), dict(n=10)),
    (poisson_arrivals, (-1.0,), dict(n=10)),
    (poisson_arrivals, (math.inf,), dict(n=10)),
    (poisson_arrivals, (1.0,), dict()),
    (poisson_arrivals, (1.0,), dict(n=10, duration=5.0)),
    (poisson_arrivals, (1.0,), dict(n=-1)),
    (poisson_arrivals, (1.0,), dict(duration=-1.0)),
    (poisson_arrivals, (1.0,), dict(duration=math.inf)),
    (gamma_arrivals, (1.0, 0.0), dict(n=10)),
    (gamma_arrivals, (1.0, -2.0), dict(n=10)),
    (gamma_arrivals, (0.0, 1.0), dict(n=10)),
    (gamma_arrivals, (1.0, 1.0), dict()),
    (on_off_arrivals, (1.0, 0.0, 1.0), dict(n=10)),
    (on_off_arrivals, (1.0, 1.0, -1.0), dict(n=10)),
    (on_off_arrivals, (-1.0, 1.0, 1.0), dict(n=10)),
    (on_off_arrivals, (1.0, 1.0, 1.0), dict(n=10, duration=5.0)),
    (bursty_arrivals, (0.0,), dict(n=10)),
    (bursty_arrivals, (1.0,), dict()),
    (bursty_arrivals, (1.0,), dict(n=10, burst_every=0.0)),
    (bursty_arrivals, (1.0,), dict(n=10, burst_seconds=0.0)),
    (bursty_arrivals, (1.0,), dict(n=10, factor=(3.0, 2.0))),
    (bursty_arrivals, (1.0,), dict(n=10, factor=(0.0, 2.0))),
    (burst_windows, (100.0,), dict(burst_every=-1.0)),
]


@pytest.mark.parametrize("fn,args,kwargs", BAD_ARGS)
def test_arrivals_reject_bad_arguments(fn, args, kwargs):
    with pytest.raises(ValueError):
        fn(*args, **kwargs)


def test_poisson_mean_gap_and_count():
    mean, cv = _mean_cv(_gaps(poisson_arrivals(4.0, n=20000, seed=1)))
    assert mean == pytest.approx(0.25, rel=0.05)
    assert cv == pytest.approx(1.0, rel=0.05)
    # 20000 expected arrivals: sd ~141, so 3% is ~4 sd.
    assert len(poisson_arrivals(4.0, duration=5000.0, seed=2)) == pytest.approx(20000, rel=0.03)


@pytest.mark.parametrize("cv", [0.5, 1.0, 2.0, 4.0])
def test_gamma_mean_and_cv(cv):
    # 10^5 gaps: at cv = 4 (shape 1/16) a smaller sample's mean wanders by several percent.
    mean, sample_cv = _mean_cv(_gaps(gamma_arrivals(2.0, cv, n=100_000, seed=3)))
    assert mean == pytest.approx(0.5, rel=0.05)
    assert sample_cv == pytest.approx(cv, rel=0.10)


def test_on_off_is_silent_when_off_and_poisson_when_on():
    on, off, rate = 5.0, 3.0, 4.0
    arrivals = on_off_arrivals(rate, on, off, duration=8000.0, seed=4)
    assert all(t % (on + off) <= on + 1e-9 for t in arrivals)
    on_time = 1000 * on  # 1000 whole periods
    assert len(arrivals) / on_time == pytest.approx(rate, rel=0.05)
    assert on_off_arrivals(rate, on, off, n=50, seed=4)[0] < on  # starts ON


def test_on_off_with_no_off_phase_is_poisson():
    mean, cv = _mean_cv(_gaps(on_off_arrivals(4.0, 1.0, 0.0, n=20000, seed=5)))
    assert mean == pytest.approx(0.25, rel=0.05) and cv == pytest.approx(1.0, rel=0.05)


def _rate_inside_vs_outside(arrivals: list[float], windows, duration: float) -> float:
    inside_time = sum(min(w.end, duration) - w.start for w in windows)
    starts = [w.start for w in windows]  # sorted, and the windows do not overlap

    def in_burst(t: float) -> bool:
        i = bisect.bisect_right(starts, t) - 1
        return i >= 0 and t < windows[i].end

    inside = sum(1 for t in arrivals if in_burst(t))
    return (inside / inside_time) / ((len(arrivals) - inside) / (duration - inside_time))


def test_bursty_rate_is_2_to_3x_inside_bursts():
    duration = 20000.0
    arrivals = bursty_arrivals(5.0, duration=duration, seed=6)
    windows = burst_windows(duration, seed=6)
    assert len(windows) > 200  # ~ duration / (60 + 15)
    ratio = _rate_inside_vs_outside(arrivals, windows, duration)
    assert 1.7 <= ratio <= 3.3
    assert ratio == pytest.approx(2.5, rel=0.1)  # the mean of U(2, 3)


def test_bursty_factor_is_respected():
    duration = 5000.0
    kw = dict(seed=9, burst_every=30.0, burst_seconds=10.0, factor=(4.0, 4.0))
    arrivals = bursty_arrivals(3.0, duration=duration, **kw)
    ratio = _rate_inside_vs_outside(arrivals, burst_windows(duration, **kw), duration)
    assert ratio == pytest.approx(4.0, rel=0.1)


def test_burst_windows_shape():
    windows = burst_windows(30000.0, seed=11)
    assert windows == burst_windows(30000.0, seed=11)
    assert windows != burst_windows(30000.0, seed=12)
    assert all(w.end - w.start == pytest.approx(15.0) for w in windows)
    assert all(2.0 <= w.factor <= 3.0 for w in windows)
    gaps = [b.start - a.end for a, b in zip(windows, windows[1:])]
    assert all(g > 0 for g in gaps)  # bursts never overlap
    assert math.fsum(gaps) / len(gaps) == pytest.approx(60.0, rel=0.15)
    assert windows[-1].start < 30000.0


@pytest.mark.parametrize("key", LENGTHS)
def test_named_lengths_hit_their_means_within_bounds(key):
    dist = LENGTHS[key]
    assert "synthetic" in dist.label and dist.name in dist.label
    pairs = dist.sample(20000, seed=13)
    assert pairs == dist.sample(20000, seed=13)
    prompts, outputs = [p for p, _ in pairs], [o for _, o in pairs]
    assert all(isinstance(x, int) for x in prompts + outputs)
    assert dist.min_prompt <= min(prompts) and max(prompts) <= dist.max_prompt
    assert dist.min_output <= min(outputs) and max(outputs) <= dist.max_output
    assert sum(prompts) / len(prompts) == pytest.approx(dist.mean_prompt, rel=0.05)
    assert sum(outputs) / len(outputs) == pytest.approx(dist.mean_output, rel=0.05)


def test_named_lengths_cite_the_papers_numbers():
    assert (LENGTHS["sharegpt-ecoserve"].mean_prompt, LENGTHS["sharegpt-ecoserve"].mean_output) \
        == pytest.approx((161, 338), abs=0.5)
    assert (LENGTHS["sharegpt-kunserve"].mean_prompt, LENGTHS["sharegpt-kunserve"].max_prompt) \
        == (1660, 4096)
    assert (LENGTHS["longbench"].mean_prompt, LENGTHS["longbench"].max_prompt) == (5900, 32000)
    assert (LENGTHS["burstgpt"].mean_prompt, LENGTHS["burstgpt"].mean_output) == (642, 262)


def test_bros_be_is_uniform_over_its_ranges():
    pairs = BROS_BE.sample(20000, seed=14)
    prompts, outputs = {p for p, _ in pairs}, {o for _, o in pairs}
    assert prompts == set(range(512, 1025))  # every value, both ends included
    assert outputs == set(range(32, 129))


def test_conserve_lengths_are_fixed():
    assert set(CONSERVE.sample(500, seed=15)) == {(1024, 128)}


@pytest.mark.parametrize("kwargs", [
    dict(mean_prompt=5, min_prompt=10),           # mean below the range
    dict(mean_output=5000, max_output=4096),      # mean above the range
    dict(mean_prompt=100, min_prompt=100, max_prompt=200),  # the bound itself is unreachable
    dict(min_prompt=0),
    dict(min_output=50, max_output=40, mean_output=45),
    dict(sigma=0.0),
])
def test_length_dist_rejects_unreachable_parameters(kwargs):
    base = dict(name="x", mean_prompt=100, mean_output=100)
    with pytest.raises(ValueError):
        LengthDist(**{**base, **kwargs})


def _quadrature_clipped_mean(mu: float, sigma: float, lo: float, hi: float) -> float:
    """E[clip(exp(mu + sigma Z), lo, hi)] by the midpoint rule over z: an independent check of
    the closed form (the solver bisects on that closed form, so it cannot check itself)."""
    steps, z_max = 20000, 12.0
    h = 2 * z_max / steps
    total = 0.0
    for i in range(steps):
        z = -z_max + (i + 0.5) * h
        total += min(max(math.exp(mu + sigma * z), lo), hi) * math.exp(-z * z / 2)
    return total * h / math.sqrt(2 * math.pi)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(lo=st.integers(1, 2000), width=st.integers(2, 30000), frac=st.floats(0.02, 0.98),
       sigma=st.floats(0.3, 2.5))
def test_solved_mu_gives_the_target_clipped_mean(lo, width, frac, sigma):
    hi = lo + width
    target = lo + frac * width
    mu = solve_mu(target, sigma, float(lo), float(hi))
    assert clipped_lognormal_mean(mu, sigma, lo, hi) == pytest.approx(target, rel=1e-6)
    assert _quadrature_clipped_mean(mu, sigma, lo, hi) == pytest.approx(target, rel=1e-3)
    # And the integer sampler lands there too, within sampling noise plus rounding.
    dist = LengthDist("prop", target, target, lo, hi, lo, hi, sigma=sigma)
    prompts = [p for p, _ in dist.sample(20000, seed=16)]
    mean = sum(prompts) / len(prompts)
    sd = math.sqrt(sum((p - mean) ** 2 for p in prompts) / (len(prompts) - 1))
    assert abs(mean - target) <= 5 * sd / math.sqrt(len(prompts)) + 0.5


def test_solve_mu_rejects_unreachable_targets():
    for target in (1.0, 0.5, 100.0, 200.0):
        with pytest.raises(ValueError):
            solve_mu(target, 1.0, 1.0, 100.0)


def test_make_trace_and_merge():
    arrivals = poisson_arrivals(2.0, n=100, seed=17)
    trace = make_trace(arrivals, SHAREGPT_ECOSERVE, seed=18, priority="offline")
    assert [r.arrival for r in trace] == arrivals
    assert [(r.prompt_len, r.output_len) for r in trace] == SHAREGPT_ECOSERVE.sample(100, seed=18)
    assert {r.priority for r in trace} == {"offline"}
    with pytest.raises(ValueError):
        make_trace(arrivals, SHAREGPT_ECOSERVE, priority="batch")

    a = [TraceRequest(1.0, 1, 1), TraceRequest(3.0, 2, 2)]
    b = [TraceRequest(1.0, 9, 9, "offline"), TraceRequest(2.0, 8, 8)]
    merged = merge_traces(a, b)
    assert merged == [a[0], b[0], b[1], a[1]]  # the tie at 1.0 keeps argument order
    assert merge_traces(b, a)[:2] == [b[0], a[0]]
    assert merge_traces() == []


def test_trace_request_validates():
    with pytest.raises(ValueError):
        TraceRequest(0.0, 0, 5)
    with pytest.raises(ValueError):
        TraceRequest(0.0, 5, 5, priority="batch")


def test_csv_round_trip(tmp_path):
    online = make_trace(bursty_arrivals(3.0, n=300, seed=19), LENGTHS["burstgpt"], seed=20)
    offline = make_trace(poisson_arrivals(1.0, n=100, seed=21), BROS_BE, seed=22,
                         priority="offline")
    trace = merge_traces(online, offline)
    path = tmp_path / "trace.csv"
    save_csv(trace, path)
    t0 = trace[0].arrival
    assert t0 > 0
    assert replay_csv(path) == [replace(r, arrival=r.arrival - t0) for r in trace]
    # A trace that already starts at 0 comes back exactly.
    shifted = replay_csv(path)
    save_csv(shifted, path)
    assert replay_csv(path) == shifted


def test_replay_sorts_shifts_and_defaults_priority(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("output_len,timestamp,prompt_len,extra\n"
                    "7,105.5,70,x\n"
                    "5,100.0,50,y\n"
                    "6,102.0,60,z\n")
    assert replay_csv(path) == [TraceRequest(0.0, 50, 5), TraceRequest(2.0, 60, 6),
                                TraceRequest(5.5, 70, 7)]
    path.write_text("timestamp,prompt_len,output_len,priority\n1.0,5,5,offline\n2.0,5,5,\n")
    assert [r.priority for r in replay_csv(path)] == ["offline", "online"]
    path.write_text("timestamp,prompt_len,output_len\n")
    assert replay_csv(path) == []


@pytest.mark.parametrize("text,match", [
    ("timestamp,prompt_len\n0,5\n", "output_len"),
    ("time,prompt_len,output_len\n0,5,5\n", "timestamp"),
    ("", "missing"),
    ("timestamp,prompt_len,output_len\n0,5,5\n1,0,5\n", ":3"),
    ("timestamp,prompt_len,output_len\n0,5,-2\n", "positive"),
    ("timestamp,prompt_len,output_len\n0,five,5\n", "bad value"),
    ("timestamp,prompt_len,output_len\n0,5\n", "bad value"),
    ("timestamp,prompt_len,output_len\nnan,5,5\n", "finite"),
    ("timestamp,prompt_len,output_len,priority\n0,5,5,batch\n", "priority"),
])
def test_replay_errors(tmp_path, text, match):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        replay_csv(path)


def test_lengths_are_independent_of_global_random_state():
    random.seed(0)
    first = LENGTHS["alpaca"].sample(100, seed=23)
    random.seed(1)
    assert LENGTHS["alpaca"].sample(100, seed=23) == first
