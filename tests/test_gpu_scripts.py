"""The GPU scripts keep working between GPU sessions (a GPU is lent to few sessions, for 15
minutes: a renamed flag or a broken code path found there costs the session its measurements).

- Every command `benchmarks/gpu_suite.py` runs parses under its script's own argument parser,
  and every checkpoint and test file it names exists.
- `benchmarks/gpu_decode.py` runs each mode the suite asks of it on the CPU stand-in: the same
  engine path, its graph steps through the static buffers without recording.
- The kernel classes that tell where a graphed step's GPU time goes sort real kernel names.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import arena, attention, gemm, gpu_decode, gpu_suite, prefix_cache, sim_fidelity, throughput

ROOT = Path(__file__).resolve().parent.parent
PARSERS = {"benchmarks.gpu_decode": gpu_decode.build_parser, "benchmarks.throughput": throughput.build_parser,
           "benchmarks.sim_fidelity": sim_fidelity.build_parser, "benchmarks.attention": attention.build_parser,
           "benchmarks.gemm": gemm.build_parser, "benchmarks.prefix_cache": prefix_cache.build_parser,
           "benchmarks.arena": arena.build_parser}


def suite_commands(monkeypatch, tmp_path: Path) -> tuple[list[list[str]], set[str]]:
    """Every command the suite's default steps (but `env`, which reads the GPU) would run, and
    the checkpoints they would build; nothing is run or built."""
    commands, built = [], set()

    def run(cmd, timeout, log, result=None):
        commands.append(cmd)
        return {"rc": 0}

    def build_checkpoint(name, cache):
        built.add(name)
        return cache / name

    monkeypatch.setattr(gpu_suite, "run", run)
    monkeypatch.setattr(gpu_suite, "build_checkpoint", build_checkpoint)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    args = gpu_suite.build_parser().parse_args(["--out", str(tmp_path), "--cache", str(tmp_path / "models")])
    options = gpu_suite.options_from(args)
    for step in args.steps.split(","):
        if step != "env":
            getattr(gpu_suite, f"step_{step}")(tmp_path, options)
    return commands, built


def test_every_command_of_the_gpu_suite_parses(monkeypatch, tmp_path):
    commands, built = suite_commands(monkeypatch, tmp_path)
    scripts = set()
    for cmd in commands:
        assert cmd[0] == sys.executable
        if cmd[1:3] == ["-m", "pytest"]:
            files = [a for a in cmd[3:] if a.startswith("tests")]
            assert files, cmd
            for f in files:
                assert (ROOT / f).exists(), f"the suite runs {f}, which is gone"
            continue
        module, rest = (cmd[2], cmd[3:]) if cmd[1] == "-m" else ("benchmarks." + Path(cmd[1]).stem, cmd[2:])
        assert (ROOT / (module.replace(".", "/") + ".py")).exists(), module
        PARSERS[module]().parse_args(rest)  # exits (SystemExit 2) on a flag the script lacks
        scripts.add(module)
    assert scripts == set(PARSERS)  # every step that runs a script was reached
    for name in built:
        assert (gpu_suite.MODELS / name / "config.json").exists(), name


@pytest.mark.parametrize("flags", [[], ["--async-scheduling"], ["--profile"], ["--eager"],
                                   ["--eager", "--stub-forward"], ["--mixed-graphs", "--async-scheduling"]],
                         ids=["graphed", "graphed-async", "profile", "eager", "stub", "mixed-async"])
def test_gpu_decode_times_a_full_batch_on_the_cpu_stand_in(tiny_llama_dir, tmp_path, flags):
    out = tmp_path / "decode.json"
    gpu_decode.main(["--model", str(tiny_llama_dir), "--device", "cpu", "--batch", "4", "--context", "40",
                     "--steps", "6", "--json", str(out)] + flags)
    result = json.loads(out.read_text())
    assert result["batch"] == 4 and result["step_ms_median"] > 0 and result["step_over_roofline"] > 0
    assert result["async_scheduling"] == ("--async-scheduling" in flags)
    graphed = "--eager" not in flags
    # Every timed step (and the profile's) is a decode of the whole batch through the graph path.
    assert (result["graph_replays"] >= 6) == graphed and (result["graph_replays"] == 0) != graphed
    phases = result["phase_ms_median"]
    assert {"schedule", "launch", "postprocess"} <= set(phases)
    assert ("execute" in phases) != ("--async-scheduling" in flags)
    if "--profile" in flags:
        assert result["kernels"] == [] and result["kernel_classes"] == {}  # a CPU has no CUDA kernels
    else:
        assert result["kernels"] is None


@pytest.mark.parametrize("flags", [[], ["--mixed-graphs", "--async-scheduling"], ["--eager"]],
                         ids=["default", "mixed-async", "eager"])
def test_gpu_decode_serves_on_the_cpu_stand_in(tiny_llama_dir, tmp_path, flags):
    out = tmp_path / "serve.json"
    gpu_decode.main(["--model", str(tiny_llama_dir), "--device", "cpu", "--serve", "12", "--prompt-range", "8",
                     "40", "--output-range", "4", "12", "--json", str(out)] + flags)
    result = json.loads(out.read_text())
    assert result["requests"] == 12 and result["output_tokens"] >= 12 * 4 and result["preemptions"] == 0
    assert result["build_used_fraction"] is None  # no device memory to read on a CPU
    graphs = result["graphs"]
    if "--eager" in flags:
        assert graphs is None
    else:
        assert graphs["decode_replays"] > 0
        assert (graphs["mixed"] > 0 and graphs["mixed_replays"] > 0) == ("--mixed-graphs" in flags)


def test_gpu_decode_refuses_a_stub_forward_through_graphs(tiny_llama_dir):
    with pytest.raises(ValueError, match="--eager"):
        gpu_decode.main(["--model", str(tiny_llama_dir), "--device", "cpu", "--batch", "2", "--context", "8",
                         "--steps", "2", "--stub-forward"])


def test_kernel_classes_sort_real_kernel_names():
    # Names as torch.profiler reports them for a graphed Llama step on an H100 (cuBLAS and ours).
    kernels = [{"kernel": "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64_warpgroupsize1x1x1",
                "ms_per_step": 0.6, "launches_per_step": 48.0},
               {"kernel": "nvjet_tst_64x8_64x16_4x1_v_bz_TNT", "ms_per_step": 0.2, "launches_per_step": 17.0},
               {"kernel": "_paged_attention_kernel", "ms_per_step": 0.5, "launches_per_step": 16.0},
               {"kernel": "_paged_decode_split_kernel", "ms_per_step": 0.1, "launches_per_step": 16.0},
               {"kernel": "_combine_splits_kernel", "ms_per_step": 0.02, "launches_per_step": 16.0},
               {"kernel": "_rope_kernel", "ms_per_step": 0.05, "launches_per_step": 16.0},
               {"kernel": "_rms_norm_kernel", "ms_per_step": 0.06, "launches_per_step": 33.0},
               {"kernel": "_silu_and_mul_kernel", "ms_per_step": 0.04, "launches_per_step": 16.0},
               {"kernel": "_store_kv_kernel", "ms_per_step": 0.01, "launches_per_step": 16.0},
               {"kernel": "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<c10::BFloat16, "
                          "at::native::ArgMaxOps>>", "ms_per_step": 0.03, "launches_per_step": 1.0}]
    bandwidth = 4.0e12
    classes = gpu_decode.kernel_classes(kernels, weight_bytes=2_400_000_000, kv_bytes=1_600_000_000,
                                        bandwidth=bandwidth)
    assert list(classes) == ["gemm", "attention", "fused ops", "other", "store_kv"]  # largest first
    assert classes["gemm"] == {"ms_per_step": 0.8, "launches_per_step": 65.0, "roofline_ms": 0.6,
                               "fraction_of_peak": 0.75}
    assert classes["attention"]["ms_per_step"] == pytest.approx(0.62)
    assert classes["attention"]["fraction_of_peak"] == pytest.approx(0.4 / 0.62, abs=1e-3)
    assert classes["fused ops"] == {"ms_per_step": 0.15, "launches_per_step": 65.0}
    assert classes["other"]["launches_per_step"] == 1.0 and "roofline_ms" not in classes["other"]


def test_gemm_shapes_are_the_models_linear_layers():
    """The 1B model's (Llama-3.2-1B's shape): QKV and gate/up merged as nanoserve runs them."""
    shapes = {s.name: s for s in gemm.model_shapes(gpu_suite.MODELS / "llama-1b")}
    assert (shapes["qkv"].n, shapes["qkv"].k) == ((32 + 2 * 8) * 64, 2048)
    assert (shapes["o"].n, shapes["o"].k, shapes["gate_up"].n, shapes["down"].k) == (2048, 2048, 2 * 8192, 8192)
    assert (shapes["lm_head"].n, shapes["lm_head"].per_forward, shapes["down"].per_forward) == (128256, 1, 16)
    rows = [gemm.Row("qkv", "cublas", 64, 3072, 2048, us=4.0, floor_us=3.0, fraction_of_peak=0.75),
            gemm.Row("lm_head", "cublas", 64, 128256, 2048, us=150.0, floor_us=120.0, fraction_of_peak=0.8)]
    totals = gemm.forward_totals(rows, list(shapes.values()))
    assert totals == {"cublas": {"64": {"ms": 0.214, "floor_ms": 0.168, "fraction_of_peak": 0.785}}}


def test_gemm_benchmark_smoke(tmp_path):
    out = tmp_path / "gemm.json"
    assert gemm.main(["--smoke", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {r["shape"] for r in result["rows"]} == {"qkv", "down", "lm_head"} and not result["errors"]
    assert all(r["us"] > 0 for r in result["rows"])


def test_the_lease_script_packs_the_suite_into_out(tmp_path):
    """`gpu_lease.sh` runs the suite with the device's python3 and leaves suite.json, suite.md
    and a tar of the steps' files in $OUT (here one step, which fails without a GPU: a failed
    step is a result too)."""
    import os
    import subprocess
    import tarfile

    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir(), out.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    env = dict(os.environ, OUT=str(out), PATH=f"{bin_dir}:{os.environ['PATH']}")
    proc = subprocess.run(["bash", "benchmarks/gpu_lease.sh", "env", "1"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["results.tar.gz", "suite.json", "suite.md"]
    assert "env" in json.loads((out / "suite.json").read_text())
    with tarfile.open(out / "results.tar.gz") as tar:
        assert not any(name.endswith("suite.json") for name in tar.getnames())


def test_throughput_takes_vllm_s_fixed_lengths_and_reports_total_tok_s(tiny_llama_dir, tmp_path):
    """The 8B headline's shape of work (`offline8b`): every request N in and M out, total tok/s
    (prompts included) and the ratio to a published figure; on the CPU stand-in."""
    out = tmp_path / "throughput.json"
    throughput.main(["--model", str(tiny_llama_dir), "--num-prompts", "3", "--input-len", "24", "--output-len", "5",
                     "--kv-cache-tokens", "1024", "--skip-hf", "--reference", "100", "--json", str(out)])
    result = json.loads(out.read_text())
    tokens = 3 * (24 + 5)
    assert result["nanoserve_total_tok_s"] == pytest.approx(tokens / result["nanoserve_s"])
    assert result["total_ratio_to_reference"] == pytest.approx(result["nanoserve_total_tok_s"] / 100)


def test_throughput_draws_lengths_from_a_named_distribution():
    args = throughput.build_parser().parse_args(["--num-prompts", "50", "--lengths", "sharegpt-ecoserve"])
    lengths = throughput.request_lengths(args)
    assert lengths is not None and len(lengths) == 50
    assert all(16 <= p <= 3200 and 19 <= o <= 991 for p, o in lengths)  # EcoServe's ShareGPT bounds
    fixed = throughput.request_lengths(throughput.build_parser().parse_args(["--input-len", "8", "--output-len", "2"]))
    assert fixed == [(8, 2)] * 64
    with pytest.raises(SystemExit):
        throughput.request_lengths(throughput.build_parser().parse_args(["--input-len", "8"]))


def test_the_8b_headline_model_has_llama_3_8b_s_shape():
    from nanoserve.model.loader import load_config

    cfg = load_config(gpu_suite.MODELS / "llama-8b")
    shape = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size)
    assert shape == (32, 4096, 32, 8, 128256)


def test_the_split_k_sweep_runs_each_minimum_on_the_cpu_stand_in(monkeypatch):
    """`attention.py --sweep`'s split-K part (MIN_SPLIT_TOKENS's data) runs and records every
    minimum; on the CPU the interpreter never splits, so only the path is checked."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(attention, "SPLIT_SWEEP_CASES", [attention.Case("decode", 1, 40, 1, heads=4, kv_heads=2,
                                                                        head_dim=16)])
    rows = attention.split_sweep(torch.float32, torch.device("cpu"))
    assert [r["tuning"]["min_split_tokens"] for r in rows] == list(attention.SWEEP_MIN_SPLIT)
    assert all(r["ms"] > 0 and r["unsplit_ms"] > 0 for r in rows)
