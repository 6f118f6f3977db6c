"""Where a CPU step's time goes: throughput.py's requests under torch.profiler, by part of the model.

The decoder layer's parts are labelled with `record_function` for the profile only (this
script wraps them; the engine carries no profiling code), so each part's total includes the
small ops it launches:

    scheduler      Scheduler.schedule + update_after_step (Python)
    prepare        the runner's input tensors (slot mapping, block tables, positions)
    linear         the decoder layers' qkv / o / gate_up / down matmuls
    lm_head        the logits of the rows sampled (the vocabulary's matmul)
    attention      store_kv + paged attention (gather, mask, SDPA)
    norm           RMSNorm (and the fused residual add + norm)
    rope           rotary embedding of q and k
    silu_mul       SiLU(gate) * up
    sample         logits -> token ids
    rest           everything else in the step (embedding, residual adds, views, output)

    python benchmarks/profile_cpu.py [--dtype float32|bfloat16] [--num-prompts 64] [--json F]

It prints each part's share of the profiled wall time and the ops with the most self time.
"""
from __future__ import annotations

import argparse
import functools
import json
import platform
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from nanoserve import LLM, SamplingParams, default_model
from nanoserve.tokenizer import Tokenizer

PARTS = ("scheduler", "prepare", "linear", "lm_head", "attention", "norm", "rope", "silu_mul", "sample")


def _labelled(label: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with record_function(label):
            return fn(*args, **kwargs)
    return wrapper


def label_parts(llm: LLM) -> None:
    """Wrap the model's parts (instances and the module functions they call) in labels."""
    import nanoserve.model.llama as llama
    from nanoserve.model.layers import MergedLinear, RMSNorm
    from nanoserve.model.parallel import ParallelLMHead, RowParallelLinear, VocabParallelEmbedding

    runner = llm.engine.executor
    model = runner.model
    for module in model.modules():
        if isinstance(module, (MergedLinear, RowParallelLinear)):
            module.forward = _labelled("linear", module.forward)
        elif isinstance(module, RMSNorm):
            module.forward = _labelled("norm", module.forward)
        elif isinstance(module, llama.PagedAttention):
            module.forward = _labelled("attention", module.forward)
    for module in model.modules():
        if isinstance(module, (ParallelLMHead, VocabParallelEmbedding)):
            module.logits = _labelled("lm_head", module.logits)
    llama.apply_rotary = _labelled("rope", llama.apply_rotary)
    llama.F = _FunctionalWithLabelledSilu(llama.F)
    fused = runner.backend.fused
    if fused is not None:
        runner.backend = type(runner.backend)(
            runner.backend.name, runner.backend.store_kv, runner.backend.paged_attention,
            type(fused)(_labelled("norm", fused.rms_norm), _labelled("norm", fused.add_rms_norm),
                        _labelled("rope", fused.rope), _labelled("silu_mul", fused.silu_and_mul)))
    runner.prepare = _labelled("prepare", runner.prepare)
    runner.sample = _labelled("sample", runner.sample)
    scheduler = llm.engine.scheduler
    scheduler.schedule = _labelled("scheduler", scheduler.schedule)
    scheduler.update_after_step = _labelled("scheduler", scheduler.update_after_step)


class _FunctionalWithLabelledSilu:
    """torch.nn.functional as llama.py sees it, with silu labelled (the product is beside it)."""

    def __init__(self, functional):
        self._functional = functional

    def __getattr__(self, name):
        attr = getattr(self._functional, name)
        return _labelled("silu_mul", attr) if name == "silu" else attr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-tokens", type=int, default=32768)
    parser.add_argument("--top", type=int, default=15, help="ops listed by self time")
    parser.add_argument("--json")
    args = parser.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from throughput import make_requests

    model = args.model or default_model()
    requests = make_requests(args.num_prompts, args.seed, Tokenizer.from_dir(model).vocab_size, first_id=17)
    llm = LLM(model, device="cpu", dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_tokens=args.kv_cache_tokens)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    llm.generate([ids for ids, _ in requests[:2]], params[:2], use_tqdm=False)  # warm-up
    label_parts(llm)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        outputs = llm.generate([ids for ids, _ in requests], params, use_tqdm=False)
        wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)

    events = prof.key_averages()
    part_us = {part: 0.0 for part in PARTS}
    for event in events:
        if event.key in part_us:
            part_us[event.key] += event.cpu_time_total
    # Nested labels (a norm inside nothing else, a linear inside nothing else) do not overlap:
    # the labelled parts are disjoint calls, so their totals add up.
    labelled = sum(part_us.values())
    shares = {part: us / 1e6 / wall for part, us in part_us.items()}
    shares["rest"] = max(0.0, 1 - labelled / 1e6 / wall)
    ops = sorted((e for e in events if e.key not in part_us and not e.key.startswith("ProfilerStep")),
                 key=lambda e: e.self_cpu_time_total, reverse=True)[: args.top]

    print(f"{platform.processor() or platform.platform()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {args.dtype}: {tokens} tokens in {wall:.2f} s profiled "
          f"({tokens / wall:.1f} tok/s; the profiler's overhead included)")
    print(f"{'part':<12}{'s':>8}{'share':>8}")
    for part, share in sorted(shares.items(), key=lambda kv: -kv[1]):
        print(f"{part:<12}{share * wall:8.2f}{share:8.1%}")
    print(f"\nops by self CPU time:\n{'op':<44}{'s':>8}{'calls':>9}")
    for e in ops:
        print(f"{e.key[:43]:<44}{e.self_cpu_time_total / 1e6:8.2f}{e.count:9d}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dtype": args.dtype, "wall_s": wall, "tokens": tokens, "shares": shares,
                       "ops": {e.key: {"self_s": e.self_cpu_time_total / 1e6, "calls": e.count} for e in ops},
                       "processor": platform.processor() or platform.platform(),
                       "threads": torch.get_num_threads(), "torch": torch.__version__}, f, indent=2)


if __name__ == "__main__":
    main()
