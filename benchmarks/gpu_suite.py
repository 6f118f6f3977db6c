"""Everything nanoserve measures on a GPU, in one command that fits a short lease of one H100/H200.

    PYTHONPATH=. python3 benchmarks/gpu_suite.py --out results/ [--steps env,tests,...]
    bash benchmarks/gpu_lease.sh      # the same in one device-tool call, packed into $OUT

It needs no network and none of the serving extras (fastapi, uvicorn, gguf): the GPU machine's
own python3 (torch, Triton, transformers, pytest) runs it. The models are random-weight
checkpoints that transformers builds on the GPU from the small config files shipped in
benchmarks/gpu_models/ (SmolLM2-135M's shape with its tokenizer, Llama-3.2-1B's, Llama-2-7B's,
Llama-3-8B's); speed does not depend on the weights' values.

Steps, in the default order (each in its own process, under its own time limit; a failure is
recorded and the next step runs):

    env           GPU, driver, library versions
    decode        decode step vs its HBM roofline (weights + KV bytes): graphed with asynchronous
                  scheduling, graphed (by kernel), eager
    gemm          benchmarks/gemm.py: the 1B model's linear layers at decode batches vs the HBM
                  roofline, cuBLAS and cuBLASLt (is the decode step's gap in its GEMMs?)
    tests         the CUDA tests (pytest -m cuda) and the newest kernels' tests (split-K, fused), compiled
    serve7b       a 7B-shaped model: start-up, KV sized from free memory, 200 requests; again with
                  mixed-step graphs and asynchronous scheduling
    offline8b     issue 47's headline: a Llama-3-8B-shaped model offline, 1,000 prompts of 256 tokens in
                  and 256 out (EOS ignored), total tok/s against vLLM's published 12,453 on one H100
                  (PR #7117); then 1,000 prompts of ShareGPT-like lengths (sim/workloads.py, EcoServe's)
    throughput    benchmarks/throughput.py vs HF generate on the same GPU, SmolLM2- and 1B-shaped; SmolLM2
                  again with mixed-step CUDA graphs and asynchronous scheduling
    attention     benchmarks/attention.py: decode/prefill vs SDPA and the HBM/TFLOP roofline
    sweep         benchmarks/attention.py --sweep: tile, launch and split settings, for the defaults
                  (head_dim 128, and 64: the 1B model's decode attention)
    fidelity      benchmarks/sim_fidelity.py: the simulator's roofline for this GPU vs the real engine,
                  its engine constants from a graphed and an eager batch-1 decode step (gpu_decode.py);
                  again with mixed-step graphs and asynchronous scheduling (the roofline's host_overlap)
    limits        issue 47's Hopper-sized defaults: offline throughput of the 1B shape under each of LIMITS
                  (token budget, max_num_seqs), from the CPU-sized default to vLLM's H100 ones and past
    arena         benchmarks/arena.py: KunServe's drop + remap on the 1B shape (the paper: about 5 ms with
                  CUDA VMM) and the background restore's copy stream beside a forward
    kernel_tests  every test that runs a Triton kernel, compiled (long: leave it out of a short lease)

It writes suite.json (every step's numbers and log tail) and suite.md (a summary table).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "benchmarks" / "gpu_models"
# The order a short lease should run them in: the decode-step goal first, then whether the new
# paths (asynchronous scheduling, mixed-step graphs, graph memory in the KV sizing) hold on CUDA.
STEPS = ["env", "decode", "gemm", "tests", "serve7b", "offline8b", "throughput", "prefix_cache", "attention", "sweep",
         "fidelity", "limits", "arena", "kernel_tests"]
# (max_num_batched_tokens, max_num_seqs) the `limits` step runs: ours today (CPU-sized), vLLM's on
# H100-class GPUs (8,192-16,384 tokens, 256 sequences), and wider.
LIMITS = ((2048, 128), (8192, 256), (16384, 256), (16384, 512))
# vLLM PR #7117 (before V1): 12,453 total tok/s offline on one H100, Llama-3-8B, 1,000 prompts of
# 256 tokens in and 256 out.
VLLM_8B_TOTAL_TOK_S = 12_453


@dataclass(frozen=True)
class Options:
    cache: Path  # where the random checkpoints go
    throughput_models: tuple[str, ...]
    decode_models: tuple[str, ...]


def build_checkpoint(name: str, cache: Path) -> Path:
    """A random-weight bf16 checkpoint of benchmarks/gpu_models/<name>, built on the GPU."""
    import shutil

    import torch
    import transformers

    out = cache / name
    if (out / "model.safetensors.index.json").exists() or (out / "model.safetensors").exists():
        return out
    src = MODELS / name
    config = transformers.AutoConfig.from_pretrained(src)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model.generation_config.eos_token_id = None
    model.save_pretrained(out, safe_serialization=True)
    for extra in ("tokenizer.json", "tokenizer_config.json"):
        if (src / extra).exists():
            shutil.copy(src / extra, out / extra)
    del model
    torch.cuda.empty_cache()
    return out


DEADLINE = [float("inf")]  # time.time() by which every step must end (--minutes)


def run(cmd: list[str], timeout: int, log: Path, result: Path | None = None) -> dict:
    """Run `cmd` under its limit (and the suite's deadline), its output to `log`; with `result`,
    the JSON the command wrote there comes back under "results"."""
    start = time.time()
    timeout = max(5, int(min(timeout, DEADLINE[0] - start)))
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=timeout, capture_output=True, text=True)
        rc, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, output = "timeout", (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
    log.write_text(output)
    report = {"rc": rc, "seconds": round(time.time() - start, 1), "tail": output[-3000:]}
    if result is not None and result.exists():
        report["results"] = json.loads(result.read_text())
    return report


def step_env(out: Path, options: Options) -> dict:
    import torch
    import transformers
    import triton

    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                          "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    props = torch.cuda.get_device_properties(0)
    return {"nvidia_smi": smi, "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
            "transformers": transformers.__version__, "device": props.name, "sms": props.multi_processor_count,
            "memory_gib": round(props.total_memory / 2**30, 1), "python": sys.version.split()[0],
            "date": time.strftime("%Y-%m-%d")}


def step_tests(out: Path, options: Options) -> dict:
    """The CUDA-marked tests, then the split-K kernel tests compiled (new kernels first)."""
    cuda_only = run([sys.executable, "-m", "pytest", "-q", "-rfEP", "-m", "cuda", "-p", "no:cacheprovider",
                     "--continue-on-collection-errors", "tests", f"--junitxml={out}/cuda_tests.xml"],
                    100, out / "tests_cuda.log")
    new = run([sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "-k", "split or fused",
               "tests/test_triton_kernels.py", "tests/test_fused_kernels.py"], 90, out / "tests_new_kernels.log")
    return {"cuda_marked": cuda_only, "new_kernels": new}


def step_kernel_tests(out: Path, options: Options) -> dict:
    """Every test that runs a Triton kernel, compiled on the GPU."""
    files = ["tests/test_triton_kernels.py", "tests/test_fused_kernels.py", "tests/test_triton_backend.py",
             "tests/test_runner_copies.py", "tests/test_bidirectional_e2e.py", "tests/test_cuda_graphs.py"]
    return run([sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *files,
                f"--junitxml={out}/kernel_tests.xml"], 200, out / "tests_kernels.log")


def step_sweep(out: Path, options: Options) -> dict:
    return run([sys.executable, "benchmarks/attention.py", "--sweep", str(out / "sweep.json")], 180, out / "sweep.log")


def step_gemm(out: Path, options: Options) -> dict:
    return run([sys.executable, "benchmarks/gemm.py", "--model", str(MODELS / options.decode_models[0]),
                "--json", str(out / "gemm.json")], 90, out / "gemm.log", out / "gemm.json")


def step_attention(out: Path, options: Options) -> dict:
    return run([sys.executable, "benchmarks/attention.py", "--json", str(out / "attention.json")], 100,
               out / "attention.log", out / "attention.json")


def step_throughput(out: Path, options: Options) -> dict:
    results = {}
    for name in options.throughput_models:
        ckpt = build_checkpoint(name, options.cache)
        path = out / f"throughput_{name}.json"
        r = run([sys.executable, "benchmarks/throughput.py", "--model", str(ckpt), "--device", "cuda",
                 "--dtype", "bfloat16", "--num-prompts", "256", "--kv-cache-tokens", "0",
                 "--json", str(path)], 90, out / f"throughput_{name}.log", path)
        results[name] = r
    # Mixed steps (prompt chunks with decodes) through CUDA graphs, with asynchronous scheduling:
    # both off by default until this run measures them (HF's number is the run above's).
    name = options.throughput_models[0]
    path = out / f"throughput_{name}_mixed_async.json"
    results[f"{name} mixed graphs + async"] = run(
        [sys.executable, "benchmarks/throughput.py", "--model", str(build_checkpoint(name, options.cache)),
         "--device", "cuda", "--dtype", "bfloat16", "--num-prompts", "256", "--kv-cache-tokens", "0",
         "--mixed-graphs", "--async-scheduling", "--skip-hf", "--json", str(path)],
        90, out / f"throughput_{name}_mixed_async.log", path)
    return results


def step_prefix_cache(out: Path, options: Options) -> dict:
    """benchmarks/prefix_cache.py's two workloads through the Triton path, caching off and on
    (issue 42; vLLM's CPU build is the CPU's peer, not run here)."""
    ckpt = build_checkpoint(options.throughput_models[0], options.cache)
    path = out / "prefix_cache.json"
    return run([sys.executable, "benchmarks/prefix_cache.py", "--model", str(ckpt), "--device", "cuda",
                "--engines", "nanoserve-off", "nanoserve-on", "--json", str(path)], 120, out / "prefix_cache.log", path)


def step_decode(out: Path, options: Options) -> dict:
    """Graphed with asynchronous scheduling, graphed (with its kernel profile), and for the first
    model eager, each in its own process (the eager step without the fused ops was measured in
    session 2: 11.1 vs 19.1 ms)."""
    results = {}
    for i, name in enumerate(options.decode_models):
        ckpt = build_checkpoint(name, options.cache)
        modes = [("graphed-async", ["--async-scheduling"]), ("graphed", ["--profile"])] + ([("eager", ["--eager"])]
                                                                                           if i == 0 else [])
        for mode, flags in modes:
            path = out / f"decode_{name}_{mode}.json"
            r = run([sys.executable, "-m", "benchmarks.gpu_decode", "--model", str(ckpt), "--json", str(path)]
                    + flags, 90, out / f"decode_{name}_{mode}.log", path)
            results[f"{name} {mode}"] = r
    return results


def step_fidelity(out: Path, options: Options) -> dict:
    """The simulator's roofline for this GPU against the real engine on the same trace, with the
    roofline's engine constants measured apart from that trace: a graphed batch-1 decode step
    (gpu_decode.py) gives the per-step and per-layer overheads (sim_fidelity --overheads-from;
    the default constants are re-priced from the saved steps with --replay)."""
    import torch

    name = torch.cuda.get_device_name()
    roofline = "H200" if "H200" in name else "H100-80G"
    ckpt = build_checkpoint("smollm2-135m", options.cache)
    constants, eager = out / "fidelity_decode_b1.json", out / "fidelity_decode_b1_eager.json"
    decode = run([sys.executable, "-m", "benchmarks.gpu_decode", "--model", str(ckpt), "--batch", "1",
                  "--context", "256", "--json", str(constants)], 60, out / "fidelity_decode.log", constants)
    eager_decode = run([sys.executable, "-m", "benchmarks.gpu_decode", "--model", str(ckpt), "--batch", "1",
                        "--context", "256", "--eager", "--json", str(eager)], 60, out / "fidelity_eager.log", eager)
    path = out / "fidelity.json"
    report = run([sys.executable, "benchmarks/sim_fidelity.py", "--model", str(ckpt), "--device", "cuda",
                  "--dtype", "bfloat16", "--roofline", roofline, "--requests", "60", "--rate", "20",
                  "--kv-tokens", "65536", "--overheads-from", str(constants), "--eager-overheads-from", str(eager),
                  "--json", str(path)], 90, out / "fidelity.log", path)
    report.get("results", {}).pop("real", None)  # the steps stay in fidelity.json
    # The engine with mixed-step graphs and asynchronous scheduling, against the roofline with the
    # same measured constants and the host's per-step work hidden under the device's.
    path = out / "fidelity_mixed_async.json"
    overlapped = run([sys.executable, "benchmarks/sim_fidelity.py", "--model", str(ckpt), "--device", "cuda",
                      "--dtype", "bfloat16", "--roofline", roofline, "--requests", "60", "--rate", "20",
                      "--kv-tokens", "65536", "--overheads-from", str(constants), "--mixed-graphs",
                      "--async-scheduling", "--json", str(path)], 90, out / "fidelity_mixed_async.log", path)
    overlapped.get("results", {}).pop("real", None)
    return {"constants": decode, "eager_constants": eager_decode, "fidelity": report,
            "fidelity_mixed_async": overlapped}


def step_serve7b(out: Path, options: Options) -> dict:
    """The 7B-shaped model served as configured by default, then with mixed-step graphs and
    asynchronous scheduling (the KV sizing measures the mixed graphs' pool: the built engine must
    still sit within gpu_memory_utilization, `build_used_fraction`)."""
    t = time.time()
    ckpt = build_checkpoint("llama-7b", options.cache)
    built = time.time() - t
    results = {}
    for mode, flags in (("default", []), ("mixed_async", ["--mixed-graphs", "--async-scheduling"])):
        path = out / f"serve7b_{mode}.json"
        results[mode] = run([sys.executable, "-m", "benchmarks.gpu_decode", "--model", str(ckpt), "--serve", "200",
                             "--json", str(path)] + flags, 200, out / f"serve7b_{mode}.log", path)
    results["checkpoint_build_s"] = round(built, 1)
    return results


def step_offline8b(out: Path, options: Options) -> dict:
    """The Llama-3-8B shape offline, as vLLM's published H100 figure was measured (fixed 256 / 256,
    `ignore_eos`), with vLLM's H100-class batch limits (256 sequences, 8,192 tokens a step), then
    ShareGPT-like lengths. Each run reports output and total tok/s."""
    t = time.time()
    ckpt = build_checkpoint("llama-8b", options.cache)
    results: dict = {"checkpoint_build_s": round(time.time() - t, 1)}
    base = [sys.executable, "benchmarks/throughput.py", "--model", str(ckpt), "--device", "cuda", "--dtype",
            "bfloat16", "--kv-cache-tokens", "0", "--max-num-seqs", "256", "--max-num-batched-tokens", "8192",
            "--skip-hf"]
    for mode, flags in (("fixed_256_256", ["--num-prompts", "1000", "--input-len", "256", "--output-len", "256",
                                           "--reference", str(VLLM_8B_TOTAL_TOK_S)]),
                        ("sharegpt", ["--num-prompts", "1000", "--lengths", "sharegpt-ecoserve"])):
        path = out / f"offline8b_{mode}.json"
        results[mode] = run(base + flags + ["--json", str(path)], 240, out / f"offline8b_{mode}.log", path)
    return results


def step_limits(out: Path, options: Options) -> dict:
    """Offline throughput of the 1B shape (1,000 prompts, the default lengths) under each of
    LIMITS: the data to choose Hopper-sized defaults from."""
    ckpt = build_checkpoint("llama-1b", options.cache)
    results = {}
    for tokens, seqs in LIMITS:
        path = out / f"limits_{tokens}_{seqs}.json"
        results[f"{tokens} tokens, {seqs} seqs"] = run(
            [sys.executable, "benchmarks/throughput.py", "--model", str(ckpt), "--device", "cuda", "--dtype",
             "bfloat16", "--num-prompts", "1000", "--kv-cache-tokens", "0", "--max-num-batched-tokens", str(tokens),
             "--max-num-seqs", str(seqs), "--skip-hf", "--json", str(path)], 90, out / f"limits_{tokens}_{seqs}.log",
            path)
    return results


def step_arena(out: Path, options: Options) -> dict:
    """KunServe's arena on the GPU (issue 47, item 7): drop + remap, and the restore's overlap."""
    path = out / "arena.json"
    ckpt = build_checkpoint("llama-1b", options.cache)
    return run([sys.executable, "benchmarks/arena.py", "--model", "llama-1b", "--checkpoint", str(ckpt),
                "--json", str(path)], 90, out / "arena.log", path)


def summary(results: dict) -> str:
    lines = [f"# GPU suite, {results.get('env', {}).get('device', '?')}, {time.strftime('%Y-%m-%d')}", ""]
    env = results.get("env", {})
    lines.append(f"- {env.get('nvidia_smi')}; torch {env.get('torch')}, Triton {env.get('triton')}, "
                 f"transformers {env.get('transformers')}")
    for name, r in results.items():
        if name == "env":
            continue
        lines.append(f"\n## {name}\n\n```\n{json.dumps(r, indent=1, default=str)[:6000]}\n```")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu-results")
    parser.add_argument("--steps", default=",".join(STEPS))
    parser.add_argument("--cache", default="/tmp/nanoserve-gpu-models", help="where the random checkpoints go")
    parser.add_argument("--throughput-models", default="smollm2-135m,llama-1b")
    parser.add_argument("--decode-models", default="llama-1b,smollm2-135m")
    # A lease is 15 minutes of device time, the machine's start included.
    parser.add_argument("--minutes", type=float, default=10.0,
                        help="every step ends by then (each has its own limit too)")
    return parser


def options_from(args: argparse.Namespace) -> Options:
    return Options(Path(args.cache), tuple(args.throughput_models.split(",")), tuple(args.decode_models.split(",")))


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    DEADLINE[0] = time.time() + 60 * args.minutes
    options = options_from(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    options.cache.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    for step in args.steps.split(","):
        t = time.time()
        print(f"== {step}", flush=True)
        try:
            results[step] = globals()[f"step_{step}"](out, options)
        except Exception as e:  # noqa: BLE001 - a failed step is a result; the suite goes on
            results[step] = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(results[step], default=str)[:2000], f"({time.time() - t:.0f} s)", flush=True)
        (out / "suite.json").write_text(json.dumps(results, indent=1, default=str))
        (out / "suite.md").write_text(summary(results))


if __name__ == "__main__":
    main()
