"""Decode steps through CUDA graphs' static buffers leave greedy output unchanged.

On a CPU the same path runs without recording (`decode_graph_sizes` given): each decode step is
copied into the static buffers, padded to its bucket and run over them; on a GPU the graphs are
recorded and replayed and compared with `enforce_eager`."""
from __future__ import annotations

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.model.cuda_graphs import decode_buckets
from test_invariance import assert_close_greedy

MAX_TOKENS = 12


def test_buckets():
    assert decode_buckets(128) == [1, 2, 4, 8] + list(range(16, 129, 8))
    assert decode_buckets(5) == [1, 2, 4, 5]
    assert decode_buckets(1) == [1]
    assert decode_buckets(20) == [1, 2, 4, 8, 16, 20]


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(1, 500, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def generate(llm: LLM, n: int):
    # Different lengths, so batches shrink through several buckets as requests finish.
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS - i % 5, ignore_eos=True, logprobs=3)
              for i in range(n)]
    return llm.generate(prompts(n), params, use_tqdm=False), params


@pytest.mark.parametrize("n", [3, 11])
def test_static_buffer_path_matches_eager_on_cpu(tiny_llama_dir, n):
    eager = LLM(str(tiny_llama_dir), device="cpu", kv_cache_tokens=2048, block_size=4)
    graphed = LLM(str(tiny_llama_dir), device="cpu", kv_cache_tokens=2048, block_size=4,
                  decode_graph_sizes=(1, 2, 4, 8))
    refs, params = generate(eager, n)
    outs, _ = generate(graphed, n)
    for ref, out, p in zip(refs, outs, params):
        assert_close_greedy(ref, out, f"request {out.request_id}", max_tokens=p.max_tokens)
    graphs = graphed.engine.executor.graphs
    assert graphs is not None and graphs.num_replays > 0
    assert eager.engine.executor.graphs is None
    assert graphed.engine.stats().kv_blocks_used == 0


def test_enforce_eager_and_other_runners_record_nothing(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cpu", kv_cache_tokens=256, decode_graph_sizes=(1, 2), enforce_eager=True)
    assert llm.engine.executor.graphs is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphs_match_eager_on_the_gpu(tiny_llama_dir, dtype):
    eager = LLM(str(tiny_llama_dir), device="cuda", dtype=dtype, kv_cache_tokens=4096, enforce_eager=True)
    graphed = LLM(str(tiny_llama_dir), device="cuda", dtype=dtype, kv_cache_tokens=4096, max_num_seqs=16)
    refs, params = generate(eager, 13)
    outs, _ = generate(graphed, 13)
    exact = sum(r.token_ids == o.token_ids for r, o in zip(refs, outs))
    for ref, out, p in zip(refs, outs, params):
        assert_close_greedy(ref, out, f"{dtype} request {out.request_id}", max_tokens=p.max_tokens)
    assert graphed.engine.executor.graphs.num_replays > 0
    print(f"{dtype}: {exact} of {len(refs)} requests token-for-token equal to eager")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_fused_layer_ops_keep_greedy_output_on_the_gpu(tiny_llama_dir):
    plain = LLM(str(tiny_llama_dir), device="cuda", dtype="bfloat16", kv_cache_tokens=4096, fused_layer_ops=False)
    fused = LLM(str(tiny_llama_dir), device="cuda", dtype="bfloat16", kv_cache_tokens=4096)
    assert plain.engine.executor.backend.fused is None and fused.engine.executor.backend.fused is not None
    refs, params = generate(plain, 13)
    outs, _ = generate(fused, 13)
    for ref, out, p in zip(refs, outs, params):
        assert_close_greedy(ref, out, f"fused request {out.request_id}", max_tokens=p.max_tokens)
    print(f"fused: {sum(r.token_ids == o.token_ids for r, o in zip(refs, outs))} of {len(refs)} token-for-token")
