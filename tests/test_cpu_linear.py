"""nanoserve/kernels/cpu_linear.py: linear layers on a CPU from oneDNN-packed weights must compute what
F.linear computes (to fp32 rounding), and an engine with packed weights must give the greedy
output of one without them (near-tie for near-tie)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from test_invariance import assert_close_greedy

from nanoserve import LLM, SamplingParams
from nanoserve.kernels import cpu_linear
from nanoserve.model.parallel import ParallelLMHead, VocabParallelEmbedding

pytestmark = pytest.mark.skipif(not cpu_linear.can_pack(torch.zeros(1)), reason="torch built without oneDNN")


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 70), st.integers(1, 300), st.integers(1, 400), st.booleans(), st.integers(0, 2**31 - 1))
def test_packed_linear_matches_f_linear(rows, inputs, outputs, with_bias, seed):
    g = torch.Generator().manual_seed(seed)
    x, weight = torch.randn(rows, inputs, generator=g), torch.randn(outputs, inputs, generator=g)
    bias = torch.randn(outputs, generator=g) if with_bias else None
    packed = cpu_linear.pack(weight)
    assert packed is not None
    out = cpu_linear.linear(x, weight, bias, packed)
    assert out.shape == (rows, outputs) and out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x, weight, bias), atol=1e-4 * inputs**0.5, rtol=1e-5)


def test_bf16_packs_where_the_cpu_can_and_falls_back_elsewhere():
    weight, x = torch.randn(64, 32, dtype=torch.bfloat16), torch.randn(5, 32, dtype=torch.bfloat16)
    packed = cpu_linear.pack(weight)  # None on a CPU without native bf16 conversion
    torch.testing.assert_close(cpu_linear.linear(x, weight, None, packed).float(), F.linear(x, weight).float(),
                               atol=0.1, rtol=0.02)


def test_the_engine_packs_every_linear_and_only_the_head_embedding(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cpu", kv_cache_tokens=1024)
    model = llm.engine.executor.model
    layers = [m for m in model.modules() if isinstance(m, cpu_linear.PackedWeight)]
    head = model.logits_head()
    assert isinstance(head, (ParallelLMHead, VocabParallelEmbedding)) and head.packed_weight is not None
    for module in layers:
        expected = module is head or not isinstance(module, torch.nn.Embedding)
        assert (module.packed_weight is not None) == expected, type(module).__name__
    unpacked = LLM(str(tiny_llama_dir), device="cpu", kv_cache_tokens=1024, cpu_packed_linears=False)
    assert all(m.packed_weight is None for m in unpacked.engine.executor.model.modules()
               if isinstance(m, cpu_linear.PackedWeight))


def test_packed_weights_keep_greedy_output(smollm2_dir):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    prompts = [[(31 * i + 7 * j) % 40000 + 100 for j in range(5 + 9 * i)] for i in range(4)]
    outputs = [LLM(str(smollm2_dir), device="cpu", kv_cache_tokens=2048, cpu_packed_linears=packed)
               .generate(prompts, params, use_tqdm=False) for packed in (False, True)]
    for i, (plain, packed) in enumerate(zip(*outputs)):
        assert_close_greedy(plain, packed, f"prompt {i}", max_tokens=24)
