"""The engine on the Triton attention backend: backend choice, and greedy output unchanged
against HF `generate` (tiny models) and against the torch backend (SmolLM2). On the CPU the
kernels run under TRITON_INTERPRET=1 (set by conftest); on a GPU they run compiled."""
from __future__ import annotations

import os

import pytest
import torch
from test_invariance import assert_close_greedy
from test_model_parity import prompts

from nanoserve import LLM, SamplingParams
from nanoserve.model.attention import default_attention_backend, get_attention_backend

# The Triton kernels run compiled on a GPU, interpreted on the CPU; fp32 either way, so that
# greedy tokens can be compared exactly with HF on the CPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1")


def test_default_backend_follows_the_device():
    assert default_attention_backend(torch.device("cuda")) == "triton"
    assert default_attention_backend(torch.device("cpu")) == "torch"


def test_triton_on_cpu_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        get_attention_backend("triton", torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        get_attention_backend("flash")


def test_llm_defaults_to_torch_on_cpu(tiny_model):
    _, _, directory = tiny_model
    llm = LLM(str(directory), device="cpu", kv_cache_tokens=256)
    assert llm.engine.executor.backend.name == "torch"


@needs_triton
def test_triton_greedy_tokens_match_hf_generate(tiny_model):
    """A token budget of 24 splits the 40-token prompt into chunks that share steps with the
    other prompts' decodes: the mixed-batch path of the kernel."""
    arch, hf, directory = tiny_model
    llm = LLM(str(directory), device=DEVICE, dtype="float32", kv_cache_tokens=4096, block_size=8,
              max_num_batched_tokens=24, attention_backend="triton")
    assert llm.engine.executor.backend.name == "triton"
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for ids, out in zip(prompts(), llm.generate(prompts(), params, use_tqdm=False)):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out.token_ids == ref[0, len(ids):].tolist(), f"{arch}: prompt of {len(ids)} tokens diverged"


@needs_triton
def test_triton_serves_smollm2_like_torch(smollm2_dir):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    texts = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,"]
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(smollm2_dir), device=DEVICE, dtype="float32", kv_cache_tokens=1024, max_num_batched_tokens=16,
                  attention_backend=backend)
        outputs[backend] = llm.generate(texts, params, use_tqdm=False)
    for text, ref, out in zip(texts, outputs["torch"], outputs["triton"]):
        assert_close_greedy(ref, out, text, max_tokens=8)
