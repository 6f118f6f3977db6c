"""The server held under load with faults (issue 44): a saturating open-loop workload through
`examples/serve.py` in its own process, where some clients misbehave, and a `kill -9` during a
batch; then what was served, what failed and how, latency, and the KV blocks left held.

    python benchmarks/server_faults.py [--num-requests 200] [--concurrency 48] [--smoke]

Each request is, at random (seeded): a streamed completion read to the end (60%); one whose
client hangs up after its first few chunks (20%); a body over the server's limit, which must get
413 (10%); a malformed body, which must get 400 (10%). Then a batch of 48 lines runs, and the
server is killed with SIGKILL once some lines are done and some not, restarted on the same
--state-dir, and the batch must finish with every line answered once. At the end, idle,
`/metrics` must show no KV block held.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import date
from pathlib import Path

import httpx
from peers.vllm_cpu import start_server  # this script's folder is on the path

ROOT = Path(__file__).resolve().parents[1]
LIMIT_MB = 1.0  # the server's --max-request-body-mb here: oversize bodies are cheap to send
BATCH_LINES = 48


def start_nanoserve(state_dir: Path, port: int, max_num_seqs: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, str(ROOT / "examples" / "serve.py"), "--port", str(port), "--state-dir", str(state_dir),
           "--max-num-seqs", str(max_num_seqs), "--max-request-body-mb", str(LIMIT_MB), "--log-level", "warning",
           "--no-request-log", "--max-model-len", "512"]
    return start_server(cmd, port, log)  # the peers' helper: up once /health answers, its log's end if not


async def one_request(client: httpx.AsyncClient, kind: str, rng: random.Random, results: list[dict]) -> None:
    start = time.perf_counter()
    body: dict | bytes
    if kind == "oversize":
        body = json.dumps({"prompt": "x " * int(LIMIT_MB * 2**20), "max_tokens": 1}).encode()
    elif kind == "malformed":
        body = b'{"prompt": "hi", "max_tokens": '
    else:
        body = {"prompt": [rng.randrange(17, 30000) for _ in range(rng.randint(16, 128))],
                "max_tokens": rng.randint(8, 48), "ignore_eos": True, "stream": True, "temperature": 0}
    try:
        if isinstance(body, bytes):
            response = await client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
            results.append({"kind": kind, "status": response.status_code, "seconds": time.perf_counter() - start})
            return
        async with client.stream("POST", "/v1/completions", json=body) as response:
            chunks = 0
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    chunks += 1
                    if kind == "hang-up" and chunks >= 3:
                        break  # leaving the block closes the connection mid-stream
            results.append({"kind": kind, "status": response.status_code, "chunks": chunks,
                            "seconds": time.perf_counter() - start})
    except httpx.HTTPError as exc:
        results.append({"kind": kind, "status": type(exc).__name__, "seconds": time.perf_counter() - start})


async def load(url: str, kinds: list[str], concurrency: int, seed: int) -> list[dict]:
    rng, results = random.Random(seed), []
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        async def guarded(kind: str) -> None:
            async with gate:
                await one_request(client, kind, rng, results)
        await asyncio.gather(*(guarded(k) for k in kinds))
    return results


def batch_lines(count: int) -> bytes:
    return "".join(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
                               "body": {"prompt": f"Batch line {i}:", "max_tokens": 64, "ignore_eos": True}}) + "\n"
                   for i in range(count)).encode()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=48)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.smoke:
        args.num_requests, args.concurrency = 16, 8
    rng = random.Random(args.seed)
    kinds = rng.choices(["complete", "hang-up", "oversize", "malformed"], weights=[6, 2, 1, 1], k=args.num_requests)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as state, tempfile.TemporaryDirectory() as logs:
        proc = start_nanoserve(Path(state), port, args.max_num_seqs, Path(logs) / "first.log")
        started = time.perf_counter()
        results = asyncio.run(load(url, kinds, args.concurrency, args.seed))
        elapsed = time.perf_counter() - started
        # Then a batch, killed with SIGKILL once some of its lines are done and some are not.
        upload = httpx.post(url + "/v1/files", files={"file": ("b.jsonl", batch_lines(BATCH_LINES))},
                            data={"purpose": "batch"}, timeout=60).json()
        batch = httpx.post(url + "/v1/batches", json={"input_file_id": upload["id"], "endpoint": "/v1/completions",
                                                      "completion_window": "24h"}, timeout=60).json()
        while True:
            before_kill = httpx.get(url + f"/v1/batches/{batch['id']}", timeout=30).json()["request_counts"]
            if before_kill["completed"] >= 1:
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc = start_nanoserve(Path(state), port, args.max_num_seqs, Path(logs) / "second.log")
        deadline = time.monotonic() + 600
        while True:
            record = httpx.get(url + f"/v1/batches/{batch['id']}", timeout=30).json()
            if record["status"] in ("completed", "failed", "cancelled") or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        output = httpx.get(url + f"/v1/files/{record['output_file_id']}/content", timeout=30).text \
            if record.get("output_file_id") else ""
        ids = [json.loads(line)["custom_id"] for line in output.splitlines() if line]
        time.sleep(1.0)
        metrics = httpx.get(url + "/metrics", timeout=30).text
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    held = [float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("nanoserve_kv_blocks_used")]
    statuses = Counter(f"{r['kind']} -> {r['status']}" for r in results)
    done = sorted(r["seconds"] for r in results if r["kind"] == "complete" and r["status"] == 200)
    result = {
        "date": date.today().isoformat(), "processor": platform.processor() or platform.machine(),
        "cores": os.cpu_count(), "requests": len(results), "seconds": elapsed, "statuses": dict(statuses),
        "complete_p50_s": statistics.median(done) if done else None,
        "complete_p99_s": done[min(len(done) - 1, int(0.99 * len(done)))] if done else None,
        "server_errors": sum(1 for r in results if isinstance(r["status"], int) and r["status"] >= 500),
        "batch": {"status": record["status"], "before_kill": before_kill, "lines_answered": len(ids),
                  "distinct": len(set(ids))},
        "kv_blocks_held_at_the_end": held[0] if held else None,
    }
    print(json.dumps(result, indent=2))
    ok = (result["server_errors"] == 0 and result["kv_blocks_held_at_the_end"] == 0
          and record["status"] == "completed" and len(ids) == len(set(ids)) == BATCH_LINES
          and before_kill["completed"] < BATCH_LINES
          and all(s.endswith("200") for s in statuses if s.startswith(("complete", "hang-up")))
          and all(s.endswith("413") for s in statuses if s.startswith("oversize"))
          and all(s.endswith("400") for s in statuses if s.startswith("malformed")))
    print("PASS" if ok else "FAIL")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if not ok:
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main()
