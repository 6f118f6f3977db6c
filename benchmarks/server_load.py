"""What HTTP and streaming cost: one open-loop Poisson workload sent through the OpenAI server
(`examples/serve.py` in its own process, streaming over HTTP) and through the in-process engine
(`AsyncEngine.generate`, the API the server itself calls, no HTTP), one after the other.

Both get the same requests at the same offsets: token-id prompts of 16-128 tokens, greedy,
`max_tokens` outputs with EOS ignored, Poisson arrivals at `--rate` (seeded). The rate is well
above what a CPU serves, so both runs are saturated and throughput is the engine's capacity; the
ratio HTTP / in-process is the share the server keeps (goal: >= 0.9). TTFT and TPOT are taken
where the client sees them: for HTTP, when the first and last content chunks arrive.

    python benchmarks/server_load.py [--num-requests 128] [--rate 32] [--max-tokens 32] [--policy fcfs]
    python benchmarks/server_load.py --smoke      # a few requests: checks that it runs
    python benchmarks/server_load.py --output-thread-ab   # in-process, outputs on/off the engine's thread
    python benchmarks/server_load.py --step-split         # per step: the engine's and the outputs' post-processing

Where the server process spends its CPU (Linux): over the timed run, each thread's CPU seconds
from /proc. The main thread is the HTTP server (parsing, validation, tokenizing, JSON, streaming);
the engine thread and torch's workers do the rest. This is the check of issue 23's question,
whether moving tokenizing and streaming off the engine's core could help TTFT; with
`--gil-switch-interval` the server runs with another `sys.setswitchinterval` (how long the
engine thread may keep the GIL while the HTTP thread waits for it). `--warmup N` sends N requests
shaped like the workload (another seed) before timing, instead of two 2-token ones: the first
longer requests after start-up pay one-off costs that otherwise land in the TTFT p99.

`--output-thread-ab` runs the in-process path twice on the same work, the outputs made on the
engine's thread and then on a thread of their own (`EngineArgs.output_thread`,
output_processor.py), and prints each thread's CPU seconds: the engine thread's are the host
work in series with a GPU's steps, what the output thread takes off it. `--step-split` times,
per step of `--max-num-seqs` decoding requests driven by `Engine.step`, the engine's half of the
post-processing (`Engine._postprocess`: append, EOS / length, core outputs) and the output
processor's (`OutputProcessor.process`: detokenize, stop strings, snapshots), without and with a
stop string in every request.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nanoserve.async_engine import AsyncEngine  # noqa: E402
from nanoserve.builder import build_engine  # noqa: E402
from nanoserve.config import EngineArgs  # noqa: E402
from nanoserve.sampling import SamplingParams  # noqa: E402
from nanoserve.slo import percentile  # noqa: E402

VOCAB = 32000  # prompt token ids are drawn below this: inside SmolLM2's, Llama's, Qwen's and OPT's vocabularies


@dataclass(frozen=True)
class Work:
    at: float  # seconds after the start
    prompt: list[int]
    max_tokens: int


@dataclass(frozen=True)
class Timing:
    arrival: float
    first: float
    last: float
    tokens: int

    @property
    def ttft(self) -> float:
        return self.first - self.arrival

    @property
    def tpot(self) -> float | None:
        return (self.last - self.first) / (self.tokens - 1) if self.tokens > 1 else None


def workload(num: int, rate: float, max_tokens: int, seed: int, vocab: int) -> list[Work]:
    rng, at, work = random.Random(seed), 0.0, []
    for _ in range(num):
        at += rng.expovariate(rate)
        length = rng.randint(16, 128)
        work.append(Work(at, [rng.randrange(100, vocab) for _ in range(length)], max_tokens))
    return work


async def open_loop(work: list[Work], send) -> list[Timing]:
    """Start each request at its offset, whatever is still running (open loop)."""
    start = time.perf_counter()

    async def one(item: Work) -> Timing:
        await asyncio.sleep(max(0.0, start + item.at - time.perf_counter()))
        return await send(item)

    return list(await asyncio.gather(*(one(item) for item in work)))


async def drive_engine(engine: AsyncEngine, work: list[Work]) -> list[Timing]:
    async def send(item: Work) -> Timing:
        arrival, first, tokens = time.perf_counter(), None, 0
        params = SamplingParams(temperature=0, max_tokens=item.max_tokens, ignore_eos=True)
        async for out in engine.generate(item.prompt, params):
            first = first or time.perf_counter()
            tokens = len(out.token_ids)
        return Timing(arrival, first, time.perf_counter(), tokens)

    return await open_loop(work, send)


async def drive_http(url: str, work: list[Work], model: str | None = None) -> list[Timing]:
    """Stream each request from /v1/completions; `model` is sent when the server needs one."""
    limits = httpx.Limits(max_connections=len(work) + 8, max_keepalive_connections=len(work) + 8)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as http:
        async def send(item: Work) -> Timing:
            arrival, first, last, tokens = time.perf_counter(), None, None, 0
            body = {"prompt": item.prompt, "max_tokens": item.max_tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}, **({"model": model} if model else {})}
            async with http.stream("POST", "/v1/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk["choices"]:
                        last = time.perf_counter()
                        first = first or last
                    else:
                        tokens = chunk["usage"]["completion_tokens"]
            return Timing(arrival, first, last, tokens)

        return await open_loop(work, send)


def warmup_work(count: int, max_tokens: int, seed: int) -> list[Work]:
    """`count` requests shaped like the workload (another seed), or two 2-token ones for 0."""
    if count <= 0:
        return [Work(0.0, list(range(100, 116)), 2)] * 2
    return workload(count, 4.0, max_tokens, seed + 1000, VOCAB)


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """Each thread's user + system CPU seconds so far (Linux /proc; empty elsewhere)."""
    seconds: dict[int, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return seconds
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue  # the thread ended
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "; utime, stime are fields 14, 15
        seconds[int(tid)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return seconds


def serve_process(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # sys.setswitchinterval must run in the server's process, before serve.py starts its threads.
    switch = ([] if args.gil_switch_interval is None else
              ["-c", f"import runpy, sys; sys.setswitchinterval({args.gil_switch_interval!r}); "
                     "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"])
    cmd = [sys.executable, *switch, str(ROOT / "examples" / "serve.py"), "--port", str(port), "--policy", args.policy,
           "--max-num-seqs", str(args.max_num_seqs), "--log-level", "warning", "--no-request-log",
           *(["--device", args.device] if args.device else []), *(["--model", args.model] if args.model else [])]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 300
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the server did not come up (exit {proc.poll()})")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)


def output_thread_ab(args: argparse.Namespace, warm: list[Work]) -> None:
    """The in-process path with outputs made on the engine's thread, then on their own."""
    work = workload(args.num_requests, args.rate, args.max_tokens, args.seed, VOCAB)
    rows = []
    for on in (False, True):
        engine = AsyncEngine.build(lambda: build_engine(EngineArgs(model=args.model, device=args.device,
                                                                   policy=args.policy,
                                                                   max_num_seqs=args.max_num_seqs)),
                                   output_thread=on)
        engine.start()
        try:
            asyncio.run(drive_engine(engine, warm))
            threads = engine.thread_ids()
            before = thread_cpu_seconds(os.getpid())
            row = summary(f"outputs on {'their own thread' if on else 'the engine thread'}",
                          asyncio.run(drive_engine(engine, work)), len(work) * args.max_tokens)
            after = thread_cpu_seconds(os.getpid())
        finally:
            engine.shutdown()
            engine.engine.shutdown()
        for name, tid in threads.items():
            row[f"{name}_cpu_s"] = after.get(tid, 0.0) - before.get(tid, 0.0) if tid is not None else 0.0
        rows.append(row)
    print(f"{args.num_requests} requests, Poisson {args.rate:g}/s, prompts 16-128 tokens, {args.max_tokens} output "
          f"tokens each, policy {args.policy}, max_num_seqs {args.max_num_seqs}, in-process; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores\n")
    print("| outputs made on | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | "
          "engine thread CPU-s | output thread CPU-s |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['path'].removeprefix('outputs on ')} | {row['tok_s']:.1f} | {row['ttft_p50_ms']:.0f} | "
              f"{row['ttft_p99_ms']:.0f} | {row['tpot_p50_ms']:.1f} | {row['tpot_p99_ms']:.1f} | "
              f"{row['engine_cpu_s']:.2f} | {row['outputs_cpu_s']:.2f} |")
    print(f"\nown thread / engine thread throughput: {rows[1]['tok_s'] / rows[0]['tok_s']:.3f}")


def step_split(args: argparse.Namespace) -> None:
    """Milliseconds per step in each half of the post-processing (the module docstring)."""
    engine = build_engine(EngineArgs(model=args.model, device=args.device, policy=args.policy,
                                     max_num_seqs=args.max_num_seqs))
    spent = {"engine": 0.0, "outputs": 0.0}

    def timed(half: str, fn):
        def run(*a, **k):
            started = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[half] += time.perf_counter() - started
        return run

    engine._postprocess = timed("engine", engine._postprocess)  # type: ignore[method-assign]
    engine.outputs.process = timed("outputs", engine.outputs.process)  # type: ignore[method-assign]
    print(f"{args.max_num_seqs} requests decoding {args.max_tokens} tokens each, policy {args.policy}; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores\n")
    print("| stop strings | steps | ms per step | engine thread's half, ms/step | output processor's half, ms/step |")
    print("|---|---|---|---|---|")
    for stop in (None, ["NEVER-APPEARS-123"]):
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, stop=stop)
        for i in range(args.max_num_seqs):
            engine.add_request(f"Tell me a story about the number {i}.", params)
        engine.step()  # the prompts' step
        steps, started = 0, time.perf_counter()
        spent.update(engine=0.0, outputs=0.0)
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        wall = time.perf_counter() - started
        print(f"| {'one, never met' if stop else 'none'} | {steps} | {wall * 1e3 / steps:.2f} | "
              f"{spent['engine'] * 1e3 / steps:.3f} | {spent['outputs'] * 1e3 / steps:.3f} |")
    engine.shutdown()


def summary(label: str, timings: list[Timing], expected_tokens: int) -> dict:
    tokens = sum(t.tokens for t in timings)
    assert tokens == expected_tokens, f"{label}: {tokens} tokens, expected {expected_tokens}"
    span = max(t.last for t in timings) - min(t.arrival for t in timings)
    ttft = [t.ttft * 1e3 for t in timings]
    tpot = [t.tpot * 1e3 for t in timings if t.tpot is not None]
    return {"path": label, "requests": len(timings), "tokens": tokens, "seconds": span, "tok_s": tokens / span,
            "ttft_p50_ms": statistics.median(ttft), "ttft_p99_ms": percentile(ttft, 99),
            "tpot_p50_ms": statistics.median(tpot) if tpot else 0.0, "tpot_p99_ms": percentile(tpot, 99) or 0.0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--rate", type=float, default=32.0, help="Poisson arrivals per second (above capacity)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--policy", default="fcfs")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--model", default=None, help="HF model directory (default: the embedded SmolLM2)")
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=0, metavar="N",
                   help="N workload-shaped requests before timing (default: two 2-token requests)")
    p.add_argument("--gil-switch-interval", type=float, default=None, metavar="S",
                   help="run the server with sys.setswitchinterval(S) (Python's default: 0.005)")
    p.add_argument("--smoke", action="store_true", help="8 requests of 4 tokens")
    p.add_argument("--step-split", action="store_true",
                   help="per step of --max-num-seqs decoding requests: the engine's and the output processor's halves")
    p.add_argument("--output-thread-ab", action="store_true",
                   help="in-process only: outputs on the engine's thread, then on their own (EngineArgs.output_thread)")
    args = p.parse_args()
    if args.smoke:
        args.num_requests, args.max_tokens = 8, 4
    warm = warmup_work(args.warmup, args.max_tokens, args.seed)
    if args.output_thread_ab:
        output_thread_ab(args, warm)
        return
    if args.step_split:
        step_split(args)
        return

    proc, url = serve_process(args)  # the server first, alone on the machine
    try:
        asyncio.run(drive_http(url, warm))
        work = workload(args.num_requests, args.rate, args.max_tokens, args.seed, VOCAB)
        cpu_before, started = thread_cpu_seconds(proc.pid), time.perf_counter()
        http = summary("HTTP (examples/serve.py, streaming)", asyncio.run(drive_http(url, work)),
                       len(work) * args.max_tokens)
        wall, cpu_after = time.perf_counter() - started, thread_cpu_seconds(proc.pid)
    finally:
        proc.terminate()
        proc.wait(60)

    engine = AsyncEngine.build(lambda: build_engine(EngineArgs(model=args.model, device=args.device,
                                                               policy=args.policy, max_num_seqs=args.max_num_seqs)))
    engine.start()
    try:
        asyncio.run(drive_engine(engine, warm))
        local = summary("in-process (AsyncEngine.generate)", asyncio.run(drive_engine(engine, work)),
                        len(work) * args.max_tokens)
    finally:
        engine.shutdown()
        engine.engine.shutdown()

    print(f"{args.num_requests} requests, Poisson {args.rate:g}/s, prompts 16-128 tokens, {args.max_tokens} output "
          f"tokens each, policy {args.policy}, max_num_seqs {args.max_num_seqs}; "
          f"{platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores\n")
    print("| path | requests | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms |")
    print("|---|---|---|---|---|---|---|")
    for row in (http, local):
        print(f"| {row['path']} | {row['requests']} | {row['tok_s']:.1f} | {row['ttft_p50_ms']:.0f} | "
              f"{row['ttft_p99_ms']:.0f} | {row['tpot_p50_ms']:.1f} | {row['tpot_p99_ms']:.1f} |")
    ratio = http["tok_s"] / local["tok_s"]
    print(f"\nHTTP / in-process throughput: {ratio:.3f} (overhead {(1 - ratio) * 100:.1f}%; goal <= 10%)")
    if cpu_after:
        used = {tid: cpu - cpu_before.get(tid, 0.0) for tid, cpu in cpu_after.items()}
        main_thread = used.pop(proc.pid, 0.0)
        print(f"The server process over the timed {wall:.1f} s: its main thread (HTTP, validation, tokenizing, "
              f"streaming) {main_thread:.1f} CPU-s ({100 * main_thread / wall:.1f}% of a core); its other threads "
              f"(engine loop, torch workers) {sum(used.values()):.1f} CPU-s"
              + (f"; GIL switch interval {args.gil_switch_interval:g} s"
                 if args.gil_switch_interval is not None else ""))


if __name__ == "__main__":
    main()
