"""One small mixed workload for the greedy-output tests of the KV managers (checkpoint, swap): a
tiny random Llama, eight prompts of 5-19 tokens, half online and half offline, 24 greedy tokens
each with logprobs (for the near-tie rule), and the reference outputs from a pool big enough
that nothing is ever preempted."""
from __future__ import annotations

import random

import pytest
from conftest import build_tiny_model

from nanoserve import LLM, SamplingParams

BLOCK = 4
MAX_TOKENS = 24
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
_rng = random.Random(0)
PROMPTS = [[_rng.randrange(1, 512) for _ in range(n)] for n in (5, 17, 9, 13, 7, 19, 11, 6)]
PRIORITIES = ["offline" if i % 2 else "online" for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama-mixed")
    build_tiny_model("llama", directory)
    return str(directory)


@pytest.fixture(scope="module")
def reference(llama_dir):
    llm = LLM(llama_dir, device="cpu", dtype="float32", kv_cache_tokens=4096, block_size=BLOCK)
    return llm.generate(PROMPTS, PARAMS, use_tqdm=False, priority=PRIORITIES)
