"""Automatic prefix caching: nanoserve with it on and off, against vLLM's CPU build with its own
on (its default) and off, on the same requests, one engine after the other (issue 42).

Two workloads, token-id prompts (ids from 17 up, no special tokens), greedy, EOS ignored:

    shared-prefix  48 requests that share a 1,024-token system prompt, each with 32 tokens of its
                   own, 32 out (the issue's held-out workload), all submitted at once
    multi-turn     16 conversations of 4 turns: a shared 256-token system prompt, then per turn a
                   64-token user message; each turn resends the whole history (the earlier
                   messages and a fixed 32-token assistant reply per earlier turn) and generates
                   32 tokens. A turn's requests are submitted together once the last turn's are
                   done, as a chat front end sends the next message after the last reply.

Each engine runs in a fresh process (nanoserve in `.venv`, vLLM in `.venv-vllm`: run
`python benchmarks/peers/vllm_cpu.py setup` once), with the same limits and the same KV pool
(`--kv-cache-tokens`, in vLLM's bytes), after a warm-up on unrelated tokens. Reported: seconds,
output tok/s, and the hit rate, the share of prompt tokens each engine took from its cache
(both report it per request: `num_cached_tokens`).

    python benchmarks/prefix_cache.py [--dtype bfloat16] [--workloads shared-prefix multi-turn]
                                      [--engines nanoserve-off nanoserve-on vllm-off vllm-on] [--json F]
    python benchmarks/prefix_cache.py sim [--json F]   # the simulator's workloads, an A100, a cluster
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
FIRST_ID = 17
ENGINES = ("nanoserve-off", "nanoserve-on", "vllm-off", "vllm-on")

Round = list[tuple[list[int], int]]  # (prompt token ids, max_tokens) submitted together


def shared_prefix(vocab: int, seed: int = 0, num_requests: int = 48, prefix: int = 1024, own: int = 32,
                  out: int = 32) -> list[Round]:
    rng = random.Random(seed)
    system = [rng.randrange(FIRST_ID, vocab) for _ in range(prefix)]
    return [[(system + [rng.randrange(FIRST_ID, vocab) for _ in range(own)], out) for _ in range(num_requests)]]


def multi_turn(vocab: int, seed: int = 0, conversations: int = 16, turns: int = 4, system_len: int = 256,
               user: int = 64, reply: int = 32, out: int = 32) -> list[Round]:
    rng = random.Random(seed)
    system = [rng.randrange(FIRST_ID, vocab) for _ in range(system_len)]
    histories = [list(system) for _ in range(conversations)]
    rounds: list[Round] = []
    for _ in range(turns):
        for history in histories:
            history += [rng.randrange(FIRST_ID, vocab) for _ in range(user)]
        rounds.append([(list(h), out) for h in histories])
        for history in histories:  # the reply the client keeps (fixed, so both engines get the same work)
            history += [rng.randrange(FIRST_ID, vocab) for _ in range(reply)]
    return rounds


WORKLOADS = {"shared-prefix": shared_prefix, "multi-turn": multi_turn}
# --smoke: the same shapes, small enough for CI to run both engines in seconds.
SMOKE = {"shared-prefix": dict(num_requests=4, prefix=64, own=8, out=4),
         "multi-turn": dict(conversations=2, turns=2, system_len=32, user=16, reply=8, out=4)}


def warmup_round(vocab: int) -> Round:
    rng = random.Random(99)
    return [([rng.randrange(FIRST_ID, vocab) for _ in range(48)], 4) for _ in range(2)]


# -- the workers, one per engine, each in its own process --------------------------------------------
def nanoserve_worker(args: argparse.Namespace) -> None:
    from nanoserve import LLM, SamplingParams

    rounds = json.loads(Path(args.requests).read_text())
    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_tokens=args.kv_cache_tokens,
              enable_prefix_caching=args.caching == "on")
    vocab = llm.tokenizer.vocab_size if llm.tokenizer is not None else 32000

    def run(work: Round) -> tuple[int, int, int]:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work]
        outputs = llm.generate([ids for ids, _ in work], params, use_tqdm=False)
        return (sum(len(o.token_ids) for o in outputs), sum(o.num_cached_tokens for o in outputs),
                sum(len(ids) for ids, _ in work))

    run(warmup_round(vocab))
    llm.reset_prefix_cache()
    report(args.json, run, rounds)


def vllm_worker(args: argparse.Namespace) -> None:
    """Runs in .venv-vllm (imports no nanoserve)."""
    from peers.vllm_cpu import kv_cache_bytes  # this script's folder is on the path; it imports no nanoserve
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    rounds = json.loads(Path(args.requests).read_text())
    cfg = json.loads((Path(args.model) / "config.json").read_text())
    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, seed=0,
              kv_cache_memory_bytes=kv_cache_bytes(args.model, args.dtype, args.kv_cache_tokens),
              enable_prefix_caching=args.caching == "on")

    def run(work: Round) -> tuple[int, int, int]:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work]
        outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids, _ in work], params, use_tqdm=False)
        return (sum(len(o.outputs[0].token_ids) for o in outputs), sum(o.num_cached_tokens or 0 for o in outputs),
                sum(len(ids) for ids, _ in work))

    run(warmup_round(cfg["vocab_size"]))
    llm.reset_prefix_cache()
    report(args.json, run, rounds)


def report(path: str, run, rounds: list[Round]) -> None:
    produced = cached = prompt = 0
    start = time.perf_counter()
    for work in rounds:
        p, c, n = run(work)
        produced, cached, prompt = produced + p, cached + c, prompt + n
    elapsed = time.perf_counter() - start
    expected = sum(n for work in rounds for _, n in work)
    assert produced == expected, f"{produced} tokens generated, {expected} asked for"
    Path(path).write_text(json.dumps({"seconds": elapsed, "tok_s": produced / elapsed, "hit_rate": cached / prompt,
                                      "cached_tokens": cached, "prompt_tokens": prompt}))


# -- the simulator: the same managers at paper scale ----------------------------------------------------
def simulated(seed: int = 0) -> dict:
    """`--sim`: the simulator's two shared-prefix workloads (sim/workloads.py) on an A100 serving
    Llama-2-7B (fcfs): caching off, on, on with the longest-prefix-first waiting order, and on
    with a host tier; then a 4-instance cluster on the multi-turn chat, routing by load alone
    against prefix-aware routing at three slacks."""
    import statistics

    from nanoserve.sim.cluster import ClusterConfig, simulate_cluster
    from nanoserve.sim.simulation import SimConfig, simulate
    from nanoserve.sim.workloads import LengthDist, multi_turn_chat, poisson_arrivals, shared_system_prompt

    own = LengthDist("chat turn", mean_prompt=200, mean_output=200, min_prompt=16, max_prompt=1024, min_output=16,
                     max_output=1024)
    traces = {"system prompt (2,048 tokens, 4 of them; 8 req/s)":
              shared_system_prompt(poisson_arrivals(8.0, n=1000, seed=seed), 2048, own, groups=4, seed=seed),
              "multi-turn chat (60 conversations x 6 turns, 512-token opening)":
              multi_turn_chat(poisson_arrivals(1.0, n=60, seed=seed), 6, 20.0, own, system_len=512, seed=seed)}
    configs = {"off": SimConfig(policy="fcfs"), "on": SimConfig(policy="fcfs", enable_prefix_caching=True),
               "on, lpm order": SimConfig(policy="fcfs", enable_prefix_caching=True,
                                          policy_options={"waiting_order": "lpm"}),
               "on, host tier 200k tokens": SimConfig(policy="fcfs", enable_prefix_caching=True,
                                                      prefix_cache_host_tokens=200_000)}
    result: dict = {}

    def row(run) -> dict:
        ttft = sorted(r.ttft for r in run.records if r.ttft is not None)
        events = run.events
        return {"ttft_mean_s": statistics.mean(ttft), "ttft_p99_s": ttft[int(0.99 * (len(ttft) - 1))],
                "duration_s": run.duration,
                "hit_rate": events.get("prefix_cache_hits", 0) / max(1, events.get("prefix_cache_queries", 0)),
                "host_hits": events.get("prefix_cache_host_hits", 0)}

    for name, trace in traces.items():
        rows = result[name] = {label: row(simulate(config, trace)) for label, config in configs.items()}
        print(f"\n{name}: A100-80G, Llama-2-7B, fcfs\n| caching | TTFT mean s | TTFT p99 s | hit rate | host hits "
              f"(tokens) |\n|---|---|---|---|---|")
        for label, r in rows.items():
            print(f"| {label} | {r['ttft_mean_s']:.3f} | {r['ttft_p99_s']:.3f} | {r['hit_rate']:.0%} | "
                  f"{r['host_hits']} |")
    chat = multi_turn_chat(poisson_arrivals(4.0, n=200, seed=seed), 5, 15.0, own, system_len=1024, seed=seed)
    cluster = result["cluster"] = {}
    print("\nmulti-turn chat on 4 instances (200 conversations x 5 turns), caching on\n| routing | TTFT mean s | "
          "TTFT p99 s | hit rate | routed by prefix |\n|---|---|---|---|---|")
    for slack in (None, 0.05, 0.1, 0.2):
        run = simulate_cluster(ClusterConfig(SimConfig(policy="fcfs", enable_prefix_caching=True), num_instances=4,
                                             prefix_slack=slack), chat)
        r = cluster["load alone" if slack is None else f"prefix, slack {slack}"] = {
            **row(run), "prefix_routed": run.events["prefix_routed"]}
        print(f"| {'load alone' if slack is None else f'prefix-aware, slack {slack}'} | {r['ttft_mean_s']:.3f} | "
              f"{r['ttft_p99_s']:.3f} | {r['hit_rate']:.0%} | {r['prefix_routed']} |")
    return result


# -- the driver ----------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", default="run", choices=("run", "sim", "worker-nanoserve", "worker-vllm"))
    parser.add_argument("--model", default=None, help="HF directory (default: the embedded SmolLM2-135M)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cpu", help="nanoserve's device (vLLM's CPU build runs on the CPU)")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-tokens", type=int, default=65536)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny workloads: a check that runs in seconds")
    parser.add_argument("--requests", default=None, help="(workers) the rounds file")
    parser.add_argument("--caching", choices=("on", "off"), default="on", help="(workers)")
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.mode == "worker-nanoserve":
        nanoserve_worker(args)
        return {}
    if args.mode == "worker-vllm":
        vllm_worker(args)
        return {}
    if args.mode == "sim":
        sim_result = simulated(args.seed)
        if args.json:
            Path(args.json).write_text(json.dumps(sim_result, indent=2))
        return sim_result

    from nanoserve import default_model

    model = str(args.model or default_model())
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    if any(e.startswith("vllm") for e in args.engines) and not VLLM_PYTHON.exists():
        raise SystemExit(f"no {VLLM_PYTHON}: run `python benchmarks/peers/vllm_cpu.py setup` first, or pass "
                         f"--engines nanoserve-off nanoserve-on")
    limits = ["--model", model, "--dtype", args.dtype, "--device", args.device, "--max-num-seqs",
              str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
              "--kv-cache-tokens", str(args.kv_cache_tokens)]
    result: dict = {"date": date.today().isoformat(), "processor": platform.processor() or platform.machine(),
                    "cores": os.cpu_count(), "model": Path(model).name, "dtype": args.dtype, "workloads": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.workloads:
            rounds = WORKLOADS[name](vocab, args.seed, **(SMOKE[name] if args.smoke else {}))
            requests = Path(tmp) / f"{name}.json"
            requests.write_text(json.dumps(rounds))
            rows = result["workloads"][name] = {}
            for engine in args.engines:
                kind, caching = engine.split("-")
                out = Path(tmp) / "out.json"
                python = sys.executable if kind == "nanoserve" else str(VLLM_PYTHON)
                subprocess.run([python, __file__, f"worker-{kind}", "--requests", str(requests), "--caching", caching,
                                "--json", str(out), *limits], check=True, cwd=tmp,
                               env={**os.environ, "PYTHONPATH": str(ROOT)} if kind == "nanoserve" else None)
                rows[engine] = json.loads(out.read_text())
                print(f"{name} {engine}: {rows[engine]['seconds']:.1f} s, {rows[engine]['tok_s']:.1f} tok/s, "
                      f"hit rate {rows[engine]['hit_rate']:.0%}", flush=True)
    print(f"\n{result['date']}; {result['processor']}, {result['cores']} cores; {result['model']}; {args.dtype}")
    for name, rows in result["workloads"].items():
        print(f"\n{name}\n| engine | seconds | output tok/s | hit rate |\n|---|---|---|---|")
        for engine, row in rows.items():
            print(f"| {engine} | {row['seconds']:.1f} | {row['tok_s']:.1f} | {row['hit_rate']:.0%} |")
        ratios = {}
        if "nanoserve-on" in rows and "nanoserve-off" in rows:
            ratios["on / off (nanoserve)"] = rows["nanoserve-on"]["tok_s"] / rows["nanoserve-off"]["tok_s"]
        if "nanoserve-on" in rows and "vllm-on" in rows:
            ratios["nanoserve-on / vllm-on"] = rows["nanoserve-on"]["tok_s"] / rows["vllm-on"]["tok_s"]
        if "nanoserve-off" in rows and "vllm-off" in rows:
            ratios["nanoserve-off / vllm-off"] = rows["nanoserve-off"]["tok_s"] / rows["vllm-off"]["tok_s"]
        for label, ratio in ratios.items():
            print(f"{label}: {ratio:.2f}x")
        result["workloads"][name]["ratios"] = ratios
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
