"""The benchmark scripts keep running: their CPU smoke modes, in a subprocess as a user runs them."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_attention_benchmark_smoke():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "benchmarks/attention.py", "--smoke"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| decode | 2 | 40 | 1 |" in proc.stdout and "| prefill | 1 | 48 | 16 |" in proc.stdout
    assert "largest difference from SDPA" in proc.stdout


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


def test_sim_speed_benchmark_smoke():
    proc = subprocess.run([sys.executable, "benchmarks/sim_speed.py", "--requests", "200", "--policies", "fcfs,bros"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| fcfs |" in proc.stdout and "| bros |" in proc.stdout and "(synthetic)" in proc.stdout


def test_sim_fidelity_benchmark_smoke():
    proc = subprocess.run([sys.executable, "benchmarks/sim_fidelity.py", "--smoke"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| TTFT p99 (s) |" in proc.stdout and "median error" in proc.stdout


def test_server_load_benchmark_smoke():
    proc = subprocess.run([sys.executable, "benchmarks/server_load.py", "--smoke"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| HTTP (examples/serve.py, streaming) | 8 |" in proc.stdout
    assert "| in-process (AsyncEngine.generate) | 8 |" in proc.stdout and "HTTP / in-process throughput" in proc.stdout
