"""Generate completions for a file of prompts, with a progress bar.

    python examples/offline.py prompts.txt                 # one prompt per line
    python examples/offline.py prompts.jsonl --chat        # {"prompt": "..."} per line, as chat turns
    python examples/offline.py prompts.txt --out out.jsonl --max-tokens 128 --temperature 0.7

Each output line is JSON: the prompt, the completion, the finish reason and the latencies.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from nanoserve import LLM, SamplingParams


def read_prompts(path: Path) -> list[str]:
    prompts = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            record = json.loads(line)
            prompts.append(record["prompt"] if isinstance(record, dict) else str(record))
        else:
            prompts.append(line)
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompts", type=Path, help="a .txt file (one prompt per line) or .jsonl with a 'prompt' field")
    parser.add_argument("--model", default=None, help="HF directory or cached hub id (default: embedded SmolLM2)")
    parser.add_argument("--out", type=Path, default=None, help="write JSONL here instead of stdout")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn in the chat template")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    args = parser.parse_args()

    prompts = read_prompts(args.prompts)
    llm = LLM(args.model, device=args.device, dtype=args.dtype, seed=args.seed)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p)
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params)

    sink = args.out.open("w") if args.out else sys.stdout
    try:
        for prompt, out in zip(prompts, outputs):
            record = {"prompt": prompt, "completion": out.text, "finish_reason": out.finish_reason,
                      "prompt_tokens": out.metrics.num_prompt_tokens,
                      "completion_tokens": out.metrics.num_output_tokens,
                      "ttft_s": out.metrics.ttft, "e2e_s": out.metrics.e2e}
            sink.write(json.dumps(record, ensure_ascii=False) + "\n")
    finally:
        if args.out:
            sink.close()


if __name__ == "__main__":
    main()
