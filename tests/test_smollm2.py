"""The embedded SmolLM2 through nanoserve against transformers reading the same GGUF."""
from __future__ import annotations

import pytest
import torch
from test_model_parity import assert_logits_close, nanoserve_prompt_logits

from nanoserve import LLM, SamplingParams
from nanoserve.tokenizer import Tokenizer

PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Ünïcödé ✓ 東京 😀 1234567 and some more words to make a longer prompt of several tokens.",
]


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return LLM(str(smollm2_dir), device="cpu", kv_cache_tokens=8192)


def test_prompt_logits_match_transformers_gguf(smollm2_dir, hf_gguf_model):
    tokenizer = Tokenizer.from_dir(smollm2_dir)
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        with torch.no_grad():
            ref = hf_gguf_model(torch.tensor([ids])).logits[0]
        assert_logits_close(nanoserve_prompt_logits(smollm2_dir, ids, block_size=16), ref)


def test_greedy_generation_matches_transformers_gguf(llm, hf_gguf_model):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for out in outputs:
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            ref = hf_gguf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                                         do_sample=False, eos_token_id=None, pad_token_id=2)
        assert out.token_ids == ref[0, ids.shape[1]:].tolist(), out.prompt


def test_chat_answer_is_paris(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # the model ends its turn with <|im_end|>
    assert out.token_ids[-1] in llm.tokenizer.eos_token_ids and "<|im_end|>" not in out.text
