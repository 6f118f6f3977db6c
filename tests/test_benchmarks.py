"""The benchmark scripts keep running: their CPU smoke modes, in a subprocess as a user runs them."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import build_tiny_model

ROOT = Path(__file__).resolve().parents[1]


def test_attention_benchmark_smoke():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "benchmarks/attention.py", "--smoke"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| decode | 2 | 40 | 1 |" in proc.stdout and "| prefill | 1 | 48 | 16 |" in proc.stdout
    assert "largest difference from SDPA" in proc.stdout


def test_arena_benchmark_smoke(tmp_path):
    """KunServe's drop and background restore on a tiny arena (benchmarks/arena.py): four layers,
    so that the drop of layers 1 and 3 moves layer 2's KV."""
    build_tiny_model("llama", tmp_path / "model", num_layers=4)
    out = tmp_path / "arena.json"
    proc = subprocess.run([sys.executable, "benchmarks/arena.py", "--smoke", "--device", "cpu", "--checkpoint",
                           str(tmp_path / "model"), "--json", str(out)], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["drop"]["layers"] == 2 and result["drop"]["kv_moved_mib"] > 0
    assert result["restore"]["pulled_gib"] >= 0 and result["restore"]["fill_plus_forward_ms"] > 0


def test_scheduler_benchmark_smoke():
    proc = subprocess.run([sys.executable, "benchmarks/scheduler.py", "--smoke", "--policies", "fcfs,priority"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| fcfs | paged |" in proc.stdout and "| priority | paged |" in proc.stdout


def test_policies_cpu_benchmark_smoke(tmp_path):
    pytest.importorskip("matplotlib")
    proc = subprocess.run([sys.executable, "benchmarks/policies_cpu.py", "--smoke", "--policies", "fcfs,priority",
                           "--plot", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| fcfs | online |" in proc.stdout and "| priority | offline |" in proc.stdout
    assert (tmp_path / "policies_cpu.png").read_bytes().startswith(b"\x89PNG")


def test_pipeline_benchmark_smoke():
    proc = subprocess.run([sys.executable, "benchmarks/pipeline.py", "--smoke"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| token count (fcfs) |" in proc.stdout and "| lookahead (kunserve) |" in proc.stdout


def test_cluster_benchmark_smoke():
    proc = subprocess.run([sys.executable, "benchmarks/cluster.py", "--smoke"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| no drop (recompute) |" in proc.stdout and "| KunServe drop |" in proc.stdout
    assert "KV capacity after the drop" in proc.stdout


def test_prefix_cache_benchmark_smoke(tmp_path):
    """Both workloads through nanoserve with caching off and on (vLLM's CPU build lives in its
    own virtualenv, which CI does not build): the same tokens generated, and hits only when on."""
    saved = tmp_path / "prefix_cache.json"
    proc = subprocess.run([sys.executable, "benchmarks/prefix_cache.py", "--smoke", "--engines", "nanoserve-off",
                           "nanoserve-on", "--dtype", "float32", "--kv-cache-tokens", "2048", "--json", str(saved)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| nanoserve-on |" in proc.stdout and "on / off (nanoserve):" in proc.stdout
    for name, rows in json.loads(saved.read_text())["workloads"].items():
        assert rows["nanoserve-off"]["hit_rate"] == 0 and rows["nanoserve-on"]["hit_rate"] > 0, name


def test_structured_benchmark_smoke(tmp_path):
    """A step of constrained decodes against unconstrained ones, and the schema workload through
    nanoserve alone (CI has no vLLM): outputs that validate."""
    saved = tmp_path / "structured.json"
    proc = subprocess.run([sys.executable, "benchmarks/structured.py", "--smoke", "--json", str(saved)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "constrained / unconstrained:" in proc.stdout
    assert json.loads(saved.read_text())["rows"]["ratio"] > 0


def test_server_faults_benchmark_smoke():
    """Misbehaving clients and a kill -9 mid-batch against a real server process: no 5xx, every
    refusal the right 4xx, the batch answered once per line, no KV block held."""
    proc = subprocess.run([sys.executable, "benchmarks/server_faults.py", "--smoke"], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("PASS"), proc.stdout + proc.stderr


def test_sampling_benchmark_smoke():
    proc = subprocess.run([sys.executable, "benchmarks/sampling.py", "--smoke"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| top-p 0.9: sort-free |" in proc.stdout and "| penalties |" in proc.stdout


def test_sim_speed_benchmark_smoke():
    proc = subprocess.run([sys.executable, "benchmarks/sim_speed.py", "--requests", "200", "--policies", "fcfs,bros"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| fcfs |" in proc.stdout and "| bros |" in proc.stdout and "(synthetic)" in proc.stdout


@pytest.mark.parametrize("flags", [[], ["--async-scheduling"]], ids=["sync", "async"])
def test_sim_fidelity_benchmark_smoke(tmp_path, flags):
    saved = tmp_path / "fidelity.json"
    proc = subprocess.run([sys.executable, "benchmarks/sim_fidelity.py", "--smoke", "--json", str(saved)] + flags,
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| TTFT p99 (s) |" in proc.stdout and "median error" in proc.stdout
    steps = json.loads(saved.read_text())["real"]["steps"]
    # under asynchronous scheduling, nearly every step is launched while the one before it runs
    assert (sum(follows for *_, follows in steps) > len(steps) // 2) == bool(flags)
    # --replay re-prices the saved real run without an engine: the same clock gives the same table.
    replay = subprocess.run([sys.executable, "benchmarks/sim_fidelity.py", "--replay", str(saved)], cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert replay.returncode == 0, replay.stdout + replay.stderr
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert [line for line in replay.stdout.splitlines() if line.startswith("| ")] == table


def test_sim_fidelity_recovers_the_roofline_constants_from_a_decode_step():
    """overheads_measured inverts the roofline: a graphed step priced by the roofline itself with
    known constants (30 us per layer; 0.4 ms per step beyond the forward) gives them back."""
    from argparse import Namespace
    from dataclasses import replace

    from benchmarks.sim_fidelity import eager_layer_overhead, overheads_measured
    from nanoserve.model.loader import load_config
    from nanoserve.sim.hardware import gpu
    from nanoserve.sim.roofline import Roofline

    model = ROOT / "benchmarks" / "gpu_models" / "smollm2-135m"
    h100 = gpu("H100-80G")
    priced = Roofline(replace(h100, efficiency=replace(h100.efficiency, layer_overhead_s=30e-6,
                                                       iteration_overhead_s=0.0)), load_config(model))
    forward_s = priced.iteration_seconds([(256 + 24, 1)] * 8)
    decode = {"model": str(model), "batch": 8, "context": 256, "steps": 48, "forward_gpu_ms": forward_s * 1e3,
              "step_ms_median": forward_s * 1e3 + 0.4}
    args = Namespace(roofline="H100-80G", model=None)
    measured = overheads_measured(decode, args)
    assert measured["layer_overhead_s"] == pytest.approx(30e-6, rel=1e-9)
    assert measured["iteration_overhead_s"] == pytest.approx(0.4e-3, rel=1e-9)
    # An eager step of the same batch, 90 us per layer launched one by one, and the same 0.4 ms.
    eager_priced = replace(priced, gpu=replace(h100, efficiency=replace(h100.efficiency, layer_overhead_s=90e-6,
                                                                        iteration_overhead_s=0.4e-3)))
    eager = {**decode, "forward_gpu_ms": None, "step_ms_median": eager_priced.iteration_seconds([(280, 1)] * 8) * 1e3}
    assert eager_layer_overhead(eager, measured["iteration_overhead_s"], args) == pytest.approx(90e-6, rel=1e-9)
    # The roofline charges the eager constant only to a step with a prefill chunk.
    both = replace(h100, efficiency=replace(h100.efficiency, layer_overhead_s=30e-6, eager_layer_overhead_s=90e-6))
    roofline = Roofline(both, load_config(model))
    assert roofline.layer_overhead([(280, 1)] * 8) == 30e-6
    assert roofline.layer_overhead([(280, 1), (0, 64)]) == 90e-6


def test_server_load_benchmark_smoke():
    proc = subprocess.run([sys.executable, "benchmarks/server_load.py", "--smoke"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| HTTP (examples/serve.py, streaming) | 8 |" in proc.stdout
    assert "| in-process (AsyncEngine.generate) | 8 |" in proc.stdout and "HTTP / in-process throughput" in proc.stdout


def test_server_load_output_modes_smoke():
    """The output thread's two measurements run: the A/B in-process, and the per-step split."""
    ab = subprocess.run([sys.executable, "benchmarks/server_load.py", "--smoke", "--output-thread-ab"], cwd=ROOT,
                        capture_output=True, text=True, timeout=600)
    assert ab.returncode == 0, ab.stdout + ab.stderr
    assert "| the engine thread |" in ab.stdout and "| their own thread |" in ab.stdout
    split = subprocess.run([sys.executable, "benchmarks/server_load.py", "--step-split", "--max-num-seqs", "4",
                            "--max-tokens", "4"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert split.returncode == 0, split.stdout + split.stderr
    assert "| none | 3 |" in split.stdout and "| one, never met | 3 |" in split.stdout
