"""BROS's experiment resumes from its saved runs (`experiments/bros.py` `_Points`, over
`experiments/points.py`): a run read back is not simulated again and gives the same rows; a
file stopped part-way simulates only what is missing. On a tiny setup (5 s of RT arrivals)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from experiments import bros
from experiments.points import SavedPoints

TINY = replace(bros.SETUPS["ci"], duration=5.0, horizon=15.0)
VARIANTS = ("B0=8, x2", "B0=256, x2")


def test_saved_points_round_trip_and_never_write_a_key_twice(tmp_path):
    path = tmp_path / "p.jsonl"
    saved = SavedPoints(path)
    saved.add("a", {"x": 1.0})
    saved.add("a", {"x": 1.0})  # simulated again (its run was needed): not written twice
    saved.add("b", {"x": float("inf")})
    again = SavedPoints(path)
    assert again.rows == {"a": {"x": 1.0}, "b": {"x": float("inf")}} and len(path.read_text().splitlines()) == 2
    assert SavedPoints(None).get("a") is None


def test_bros_ablation_resumes_from_saved_runs(tmp_path, monkeypatch):
    path = tmp_path / "bros.jsonl"
    first = bros.run_ablation(TINY, 0, VARIANTS, bros._Points(path))
    assert len(path.read_text().splitlines()) == len(VARIANTS)

    def no_simulation(*args, **kwargs):
        raise AssertionError("a saved run was simulated again")

    monkeypatch.setattr(bros, "simulate", no_simulation)
    assert bros.run_ablation(TINY, 0, VARIANTS, bros._Points(path)) == first
    with pytest.raises(AssertionError, match="simulated again"):  # another seed is not saved
        bros.run_ablation(TINY, 1, VARIANTS, bros._Points(path))

    monkeypatch.undo()
    path.write_text(path.read_text().splitlines()[0] + "\n")  # stopped after the first variant
    calls = []
    original = bros.simulate
    monkeypatch.setattr(bros, "simulate", lambda *a, **k: calls.append(1) or original(*a, **k))
    assert bros.run_ablation(TINY, 0, VARIANTS, bros._Points(path)) == first and len(calls) == 1


def test_fig13_reads_with_bi_cache_from_the_sweeps_saved_bros_run(tmp_path, monkeypatch):
    """Fig. 13's "With Bi-cache" is BROS as the sweep ran it: when that run was saved, not kept,
    it is read back, and only "No Bi-cache" is simulated."""
    setup = replace(TINY, rates=(10.0,), rate_rule="paper")
    fresh = bros.run_fig13(setup, 0, {}, bros._Points(tmp_path / "fresh.jsonl"), readings=1)
    ran = bros._Points(tmp_path / "fresh.jsonl")
    with_bi_cache = next(row for key, row in ran.rows.items() if "With Bi-cache" in key)
    path = tmp_path / "swept.jsonl"
    bros._Points(path).add(bros._Points.key(setup, bros.BROS, bros.fig13_rate(setup), 0), with_bi_cache)
    calls = []
    original = bros.simulate
    monkeypatch.setattr(bros, "simulate", lambda *a, **k: calls.append(1) or original(*a, **k))
    assert bros.run_fig13(setup, 0, {}, bros._Points(path), readings=1) == fresh and len(calls) == 1
