"""`nanoserve bench [MODEL]`: offline throughput of one engine configuration, as vLLM's
`vllm bench throughput` measures it: N requests of random prompt tokens, all submitted at once,
greedy with EOS ignored so that each produces exactly its output length; after a two-request
warm-up, the wall time of `LLM.generate` over all of them.

    nanoserve bench --num-prompts 64 --input-len 128 --output-len 64
    nanoserve bench /path/to/model --device cuda --json bench.json

It measures nanoserve alone. The comparisons with a peer on the same work (HF transformers,
vLLM's CPU build, the roofline) are the scripts in the checkout's `benchmarks/`.
"""
from __future__ import annotations

import argparse
import json
import random
import time

from nanoserve.builder import model_path
from nanoserve.engine_flags import add_engine_arguments, engine_args_from
from nanoserve.llm import LLM
from nanoserve.model.loader import load_config
from nanoserve.sampling import SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=64, help="requests (default: 64)")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens per request (default: 128)")
    parser.add_argument("--output-len", type=int, default=64, help="output tokens per request (default: 64)")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> dict[str, float]:
    if min(args.num_prompts, args.input_len, args.output_len) < 1:
        raise SystemExit("--num-prompts, --input-len and --output-len must be >= 1")
    engine_args = engine_args_from(args)
    vocab = load_config(model_path(engine_args)).vocab_size
    llm = LLM(**vars(engine_args))
    rng = random.Random(args.seed)
    # Token ids past the first few hundred (no special tokens, whatever the tokenizer), where the
    # vocabulary has that many.
    prompts = [[rng.randrange(min(256, vocab // 2), vocab) for _ in range(args.input_len)]
               for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up: kernels built, caches filled
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outputs)
    result = {"requests": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
              "seconds": elapsed, "requests_per_s": args.num_prompts / elapsed,
              "output_tokens_per_s": generated / elapsed,
              "total_tokens_per_s": (generated + args.num_prompts * args.input_len) / elapsed}
    llm.shutdown()
    print(f"{args.num_prompts} requests ({args.input_len} in, {args.output_len} out) in {elapsed:.2f} s: "
          f"{result['requests_per_s']:.2f} req/s, {result['output_tokens_per_s']:.1f} output tok/s, "
          f"{result['total_tokens_per_s']:.1f} total tok/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    return result
