"""Offline throughput: nanoserve's LLM.generate against HF transformers' batched generate.

Both run in this process on the same 64 requests (SmolLM2-135M-Instruct by default; inputs
16-256 tokens, outputs 16-128 tokens, greedy, EOS ignored, fixed seed) and the script prints
generated tokens per second for each and their ratio.

HF's `generate` runs a static batch: every row decodes until the longest request is done, so
it computes max(output) tokens per row. Only the tokens each request asked for count as
useful output, for both engines; HF's raw rate (all rows, all steps) is printed too.

    python benchmarks/throughput.py [--num-prompts 64] [--device cpu] [--dtype float32]
    python benchmarks/throughput.py --device cuda --dtype bfloat16   # Triton attention on the GPU

`--input-len N --output-len M` gives every request N prompt tokens and M output tokens instead
(vLLM's `benchmark_throughput` with its random dataset); `--lengths sharegpt-ecoserve` (any key
of nanoserve/sim/workloads.py `LENGTHS`) draws them from that synthetic distribution. Total
tok/s counts prompt and output tokens, as vLLM's "total" does; `--reference TOK_S` prints the
ratio to a published total (vLLM PR #7117: 12,453 tok/s on one H100, Llama-3-8B, 1,000 prompts
of 256 in and 256 out).
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from nanoserve import LLM, SamplingParams, default_model


def make_requests(num: int, seed: int, vocab: int, first_id: int,
                  lengths: list[tuple[int, int]] | None = None) -> list[tuple[list[int], int]]:
    """(prompt token ids drawn from [first_id, vocab), output length) per request: lengths from
    `lengths` ((prompt, output) pairs), else uniform in 16-256 in and 16-128 out."""
    g = torch.Generator().manual_seed(seed)
    requests = []
    for k in range(num):
        if lengths is None:
            n_in = int(torch.randint(16, 257, (1,), generator=g))
            n_out = int(torch.randint(16, 129, (1,), generator=g))
        else:
            n_in, n_out = lengths[k]
        requests.append((torch.randint(first_id, vocab, (n_in,), generator=g).tolist(), n_out))
    return requests


def request_lengths(args: argparse.Namespace) -> list[tuple[int, int]] | None:
    """The (prompt, output) lengths `--input-len/--output-len` or `--lengths` ask for (None: the default)."""
    if args.lengths is not None:
        from nanoserve.sim.workloads import LENGTHS

        return LENGTHS[args.lengths].sample(args.num_prompts, seed=args.seed)
    if args.input_len is not None or args.output_len is not None:
        if args.input_len is None or args.output_len is None:
            raise SystemExit("--input-len and --output-len go together")
        return [(args.input_len, args.output_len)] * args.num_prompts
    return None


def run_nanoserve(model: str, requests, args) -> tuple[float, int, LLM]:
    llm = LLM(model, device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_tokens=args.kv_cache_tokens or None,
              attention_backend=args.attention_backend, mixed_graphs=args.mixed_graphs,
              async_scheduling=args.async_scheduling)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    llm.generate([ids for ids, _ in requests[:2]], params[:2], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate([ids for ids, _ in requests], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.token_ids) for o in outputs)
    assert produced == sum(n for _, n in requests)
    return elapsed, produced, llm


def run_hf(model: str, requests, args) -> tuple[float, int, int]:
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(args.device).eval()
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    width = max(len(ids) for ids, _ in requests)
    input_ids = torch.full((len(requests), width), pad, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for row, (ids, _) in enumerate(requests):  # left padding, as HF generation expects
        input_ids[row, width - len(ids):] = torch.tensor(ids)
        mask[row, width - len(ids):] = 1
    longest = max(n for _, n in requests)
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=pad)
    with torch.no_grad():
        hf.generate(input_ids[:2].to(args.device), attention_mask=mask[:2].to(args.device), max_new_tokens=4, **kwargs)
        start = time.perf_counter()
        out = hf.generate(input_ids.to(args.device), attention_mask=mask.to(args.device),
                          max_new_tokens=longest, min_new_tokens=longest, **kwargs)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    assert out.shape[1] - width == longest
    return elapsed, sum(n for _, n in requests), len(requests) * longest


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF directory (default: the embedded SmolLM2)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-tokens", type=int, default=32768,
                        help="0: the engine's own sizing (on CUDA, what the weights leave)")
    parser.add_argument("--attention-backend", default=None, help="torch | triton (default: per device)")
    parser.add_argument("--mixed-graphs", action="store_true",
                        help="CUDA graphs for mixed prefill/decode steps too (nanoserve/model/cuda_graphs.py)")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="launch step n+1 before step n's tokens reach the host (nanoserve/engine.py)")
    parser.add_argument("--input-len", type=int, default=None, help="every prompt this many tokens")
    parser.add_argument("--output-len", type=int, default=None, help="every output this many tokens")
    parser.add_argument("--lengths", default=None, help="draw lengths from nanoserve.sim.workloads.LENGTHS[KEY]")
    parser.add_argument("--reference", type=float, default=None,
                        help="a published total tok/s for the same work (prompt + output tokens per second)")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--json", help="also write the results to this file")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    model = args.model or default_model()
    from pathlib import Path

    from nanoserve.model.loader import load_config
    from nanoserve.tokenizer import Tokenizer

    # A random-weight checkpoint built from a config (benchmarks/gpu_suite.py) has no tokenizer.
    vocab = (Tokenizer.from_dir(model).vocab_size if (Path(model) / "tokenizer.json").exists()
             else load_config(Path(model)).vocab_size)
    # SmolLM2's control tokens are ids 0-16; prompts use only ordinary tokens.
    requests = make_requests(args.num_prompts, args.seed, vocab, first_id=17, lengths=request_lengths(args))
    print(f"{len(requests)} requests: {sum(len(i) for i, _ in requests)} prompt tokens, "
          f"{sum(n for _, n in requests)} output tokens; device {args.device}, {args.dtype}, "
          f"torch threads {torch.get_num_threads()}")

    ns_time, ns_tokens, llm = run_nanoserve(model, requests, args)
    prompt_tokens = sum(len(ids) for ids, _ in requests)
    result = {"nanoserve_tok_s": ns_tokens / ns_time, "nanoserve_total_tok_s": (prompt_tokens + ns_tokens) / ns_time,
              "nanoserve_s": ns_time, "preemptions": llm.engine.stats().num_preemptions}
    print(f"nanoserve   : {ns_tokens} tokens in {ns_time:6.2f} s = {ns_tokens / ns_time:7.1f} tok/s "
          f"(total, prompts included: {result['nanoserve_total_tok_s']:.1f} tok/s)")
    if args.reference:
        result["reference_total_tok_s"] = args.reference
        result["total_ratio_to_reference"] = result["nanoserve_total_tok_s"] / args.reference
        print(f"total tok/s / the published reference ({args.reference:g}): {result['total_ratio_to_reference']:.2f}x")
    llm_backend = llm.engine.executor.backend.name
    print(f"nanoserve attention backend: {llm_backend}")
    del llm
    if not args.skip_hf:
        hf_time, hf_useful, hf_raw = run_hf(model, requests, args)
        result.update(hf_tok_s=hf_useful / hf_time, hf_raw_tok_s=hf_raw / hf_time, hf_s=hf_time,
                      ratio=(ns_tokens / ns_time) / (hf_useful / hf_time))
        print(f"HF generate : {hf_useful} useful tokens in {hf_time:6.2f} s = {hf_useful / hf_time:7.1f} tok/s "
              f"(raw, incl. static-batch padding: {hf_raw / hf_time:.1f} tok/s)")
        print(f"ratio nanoserve / HF = {result['ratio']:.2f}x")
    result.update(machine=platform.machine(), processor=platform.processor() or platform.platform(),
                  device=args.device, dtype=args.dtype, attention_backend=llm_backend,
                  num_prompts=args.num_prompts, seed=args.seed)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
