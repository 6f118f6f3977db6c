"""The sampler's cost per step: every sampling parameter beside greedy, and top-k/top-p without
sorting the vocabulary against the full sort it replaced (issue 43).

    python benchmarks/sampling.py [--smoke] [--json F]

Two tables:

* `sampler`: the sampler alone on a batch of SmolLM2's own next-token logits (49,152 tokens),
  rows of 8 and 64: greedy, temperature, top-k 50, top-p 0.9 (at temperature 0.8 the nucleus is
  a few tokens; at 1.0 up to ~150, past the first tier of candidates; on flat random logits it
  is thousands wide and the bisection runs),
  min_p, the three penalties over 256 generated tokens, and the full-sort top-k/top-p nanoserve
  used before (`sorted_top_k_top_p` below, kept here as the baseline).
* `engine`: a decode step of 32 requests on the embedded SmolLM2 with each setting (the
  forward included), so a reader sees what sampling costs in a step.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from datetime import date
from pathlib import Path

import torch

from nanoserve.model.logits_processors import RowHistory
from nanoserve.model.sampler import sample
from nanoserve.sampling import SamplingParams

SETTINGS = {
    "greedy": SamplingParams(temperature=0),
    "temperature 0.8": SamplingParams(temperature=0.8),
    "top-k 50": SamplingParams(temperature=0.8, top_k=50),
    "top-p 0.9": SamplingParams(temperature=0.8, top_p=0.9),
    "top-p 0.9, temperature 1.0": SamplingParams(temperature=1.0, top_p=0.9),
    "top-k 50 + top-p 0.9": SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
    "min_p 0.05": SamplingParams(temperature=0.8, min_p=0.05),
    "penalties": SamplingParams(temperature=0.8, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1),
    "greedy + penalties": SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.5,
                                         repetition_penalty=1.1),
}


def sorted_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The full-sort top-k/top-p nanoserve used before issue 43 (the baseline)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
    ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    drop = ranks >= k.unsqueeze(1)
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p.unsqueeze(1)
    drop[:, 0] = False
    return torch.empty_like(logits).scatter_(1, order, sorted_logits.masked_fill(drop, float("-inf")))


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def model_logits(rows: int) -> torch.Tensor:
    """Real next-token logits of the embedded model (peaked, as a trained model's are)."""
    from nanoserve import LLM

    llm = LLM(device="cpu", dtype="float32", kv_cache_tokens=8192)
    engine = llm.engine
    runner = engine.executor
    captured: list[torch.Tensor] = []
    real_draw = runner.draw

    def keep(sampling, logits, masks=None):
        captured.append(logits.clone())
        return real_draw(sampling, logits, masks)

    runner.draw = keep  # type: ignore[method-assign]
    prompts = [f"Story {i}: once upon a time, in a land of {w}," for i, w in
               enumerate(["ice", "fire", "sand", "glass", "iron", "silk", "salt", "rain"] * (rows // 8 + 1))][:rows]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    llm.shutdown()
    return torch.cat(captured)[:rows]


def sampler_table(rows_list: list[int], repeats: int) -> dict:
    result: dict = {}
    generator = torch.Generator().manual_seed(0)
    for rows in rows_list:
        peaked = model_logits(rows)
        flat = torch.randn(rows, peaked.shape[1], generator=generator) * 0.5
        g = torch.Generator().manual_seed(1)
        histories = [RowHistory(torch.randint(0, peaked.shape[1], (256,), generator=g).tolist(),
                                torch.randint(0, peaked.shape[1], (64,), generator=g).tolist()) for _ in range(rows)]
        table = {}
        for name, params in SETTINGS.items():
            table[name] = timed(lambda: sample(peaked.clone(), [params] * rows, [None] * rows, generator, histories),
                                repeats)
        top_p = SETTINGS["top-p 0.9"]
        table["top-p 0.9, flat logits"] = timed(
            lambda: sample(flat.clone(), [top_p] * rows, [None] * rows, generator, histories), repeats)
        k0, p9 = torch.zeros(rows, dtype=torch.long), torch.full((rows,), 0.9)
        table["top-p 0.9: full sort (before)"] = timed(lambda: sorted_top_k_top_p(peaked / 0.8, k0, p9), repeats)
        from nanoserve.model.logits_processors import apply_top_k_top_p
        table["top-p 0.9: sort-free"] = timed(lambda: apply_top_k_top_p(peaked / 0.8, k0, p9), repeats)
        table["top-p 0.9, flat: full sort (before)"] = timed(lambda: sorted_top_k_top_p(flat, k0, p9), repeats)
        table["top-p 0.9, flat: sort-free"] = timed(lambda: apply_top_k_top_p(flat, k0, p9), repeats)
        result[rows] = table
    return result


def engine_table(batch: int, steps: int) -> dict:
    from nanoserve import LLM

    llm = LLM(device="cpu", dtype="float32", max_num_seqs=batch, kv_cache_tokens=65536)
    engine = llm.engine
    table = {}
    for name, params in SETTINGS.items():
        params = params.replace(max_tokens=steps + 8, ignore_eos=True, seed=None)
        requests = [engine.add_request(f"Item {i}: the weather today is", params) for i in range(batch)]
        while any(r.num_output_tokens == 0 for r in requests):
            engine.step()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        while engine.has_unfinished_requests():
            engine.step()
        table[name] = 1e3 * statistics.median(times)
    return table


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rows_list, repeats, batch, steps = ([8], 2, 4, 2) if args.smoke else ([8, 64], 10, 32, 12)
    result = {"date": date.today().isoformat(), "processor": platform.processor() or platform.machine(),
              "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
              "sampler_ms": sampler_table(rows_list, repeats), "engine_step_ms": engine_table(batch, steps)}
    print(f"\nsampler alone, ms (median of {repeats})\n| setting | " + " | ".join(f"{r} rows" for r in rows_list)
          + " |\n|---|" + "---|" * len(rows_list))
    for name in result["sampler_ms"][rows_list[0]]:
        print(f"| {name} | " + " | ".join(f"{result['sampler_ms'][r][name]:.2f}" for r in rows_list) + " |")
    greedy = result["engine_step_ms"]["greedy"]
    print(f"\na decode step of {batch} requests on SmolLM2-135M, ms (median of {steps})\n| setting | ms | vs greedy |"
          "\n|---|---|---|")
    for name, ms in result["engine_step_ms"].items():
        print(f"| {name} | {ms:.1f} | {ms / greedy:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
