"""Steps through CUDA graphs' static buffers leave greedy output unchanged: decode graphs, and
mixed graphs (prompt chunks with decodes, padded to a token count and to max_num_seqs).

On a CPU the same path runs without recording (`decode_graph_sizes`, `mixed_graph_sizes` given):
each step is copied into the static buffers, padded to its graph's shape and run over them; on a
GPU the graphs are recorded and replayed and compared with `enforce_eager`. The Triton kernels
run the mixed path too, interpreted on the CPU: padding sequences and tokens of no sequence are
theirs to skip."""
from __future__ import annotations

import os

import pytest
import torch
from test_invariance import assert_close_greedy

from nanoserve import LLM, SamplingParams
from nanoserve.model.cuda_graphs import decode_buckets, mixed_buckets

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


@pytest.mark.parametrize("policy,replays", [("fcfs", True), ("conserve", False)])
def test_only_a_policy_that_stops_forwards_arms_safe_points(tiny_llama_dir, policy, replays):
    """A pure-offline batch has ConServe's safe points armed (it runs eagerly, waiting for the
    device at each) only under a policy that can ask a forward to stop; under fcfs nothing
    would ask, so it keeps its CUDA graph."""
    llm = LLM(str(tiny_llama_dir), device="cpu", kv_cache_tokens=2048, block_size=4, policy=policy,
              decode_graph_sizes=(1, 2, 4))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([[1, 2, 3], [4, 5, 6, 7]], params, use_tqdm=False, priority="offline")
    assert [len(o.token_ids) for o in outs] == [6, 6]
    runner = llm.engine.executor
    assert runner.layerwise_preemption is not replays
    assert (runner.graphs.num_replays > 0) is replays


def test_mixed_buckets():
    assert mixed_buckets(128, 2048) == [256, 384, 512, 768, 1024, 1536, 2048]
    assert mixed_buckets(8, 64) == [16, 24, 32, 48, 64]
    assert mixed_buckets(6, 20) == [8, 12, 16, 20]
    assert mixed_buckets(64, 64) == []  # no batch has more tokens than sequences


MIXED = dict(max_num_seqs=8, max_num_batched_tokens=64, decode_graph_sizes=(1, 2, 4, 8),
             mixed_graph_sizes=(16, 32, 64))


# A padding token belongs to no sequence, so no kernel writes its attention output: its row holds
# whatever memory was there, and the interpreter may warn as later layers multiply it. Never read.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_mixed_batches_through_the_static_buffers_keep_greedy_output(tiny_llama_dir, backend):
    """A 64-token budget chunks the longer prompts and mixes them with other requests' decodes:
    those steps run through the mixed graphs' buffers, padded to 16, 32 or 64 tokens and to 8
    sequences; decode-only steps through the decode graphs'."""
    if backend == "triton" and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1")
    common = dict(device="cpu", dtype="float32", kv_cache_tokens=2048, block_size=4, attention_backend=backend)
    eager = LLM(str(tiny_llama_dir), max_num_seqs=8, max_num_batched_tokens=64, **common)
    graphed = LLM(str(tiny_llama_dir), **MIXED, **common)
    n = 11 if backend == "torch" else 6
    refs, params = generate(eager, n)
    outs, _ = generate(graphed, n)
    for ref, out, p in zip(refs, outs, params):
        assert_close_greedy(ref, out, f"request {out.request_id}", max_tokens=p.max_tokens)
    graphs = graphed.engine.executor.graphs
    assert graphs.num_mixed_replays > 0 and graphs.num_replays > 0
    assert graphed.engine.stats().kv_blocks_used == 0
    # A batch of two sequences (3 new tokens, then 1), padded to 16 tokens and 8 sequences: the
    # kernels find a token's sequence by binary search, so the padded starts must not decrease.
    layout, buffer = graphs.inputs_for("mixed", 4)
    assert (layout.num_tokens, layout.num_seqs) == (16, 8)
    buffer.copy_(layout.pack([5, 6, 7, 9], [0, 1, 2, 4], [0, 1, 2, 8], [2, 3], [3, 5], [0, 3, 4], pin_memory=False))
    graphs.write_block_table(torch.tensor([[0, 1], [2, 0]], dtype=torch.int32))
    logits = graphs.replay_mixed(4, 2)
    assert logits.shape[0] == 2 and torch.isfinite(logits).all()
    views = graphs.views("mixed", 16)
    assert views.query_start_loc.tolist() == [0, 3, 4] + [4] * 6 and views.seq_lens.tolist() == [3, 5] + [1] * 6
    assert views.slot_mapping[4:].tolist() == [-1] * 12 and views.sample_index.tolist() == [2, 3] + [0] * 6


def test_mixed_graphs_need_more_tokens_than_sequences(tiny_llama_dir):
    with pytest.raises(ValueError, match="more tokens than sequences"):
        LLM(str(tiny_llama_dir), device="cpu", kv_cache_tokens=256, max_num_seqs=16, mixed_graph_sizes=(16, 32))


def test_enforce_eager_and_other_runners_record_nothing(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cpu", kv_cache_tokens=256, decode_graph_sizes=(1, 2), enforce_eager=True)
    assert llm.engine.executor.graphs is None


def test_cuda_records_only_a_backend_a_graph_can_capture():
    """torch's attention reads the batch's shape on the host (a capture refuses `.tolist()`): on
    CUDA it runs eagerly, and sizes named for it are refused; Triton's kernels are recorded.
    (graph_sizes only reads the device's type: no GPU is needed.)"""
    from nanoserve.config import EngineArgs
    from nanoserve.model.rank import graph_sizes

    cuda = torch.device("cuda")
    assert graph_sizes(EngineArgs(attention_backend="torch", mixed_graphs=True), cuda, 1) == ((), ())
    with pytest.raises(ValueError, match="triton backend, or enforce_eager"):
        graph_sizes(EngineArgs(attention_backend="torch", decode_graph_sizes=(1, 2)), cuda, 1)
    triton = graph_sizes(EngineArgs(attention_backend="triton", mixed_graphs=True, max_num_seqs=16), cuda, 1)
    assert triton == (tuple(decode_buckets(16)), tuple(mixed_buckets(16, 2048)))
    # On a CPU named sizes run the same path without recording, whatever the backend (tests).
    assert graph_sizes(EngineArgs(attention_backend="torch", decode_graph_sizes=(1, 2)), torch.device("cpu"), 1) \
        == ((1, 2), ())


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


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_mixed_graphs_match_eager_on_the_gpu(tiny_llama_dir):
    """Recorded mixed graphs (and decode graphs, with asynchronous scheduling) against eager."""
    common = dict(device="cuda", dtype="float32", kv_cache_tokens=4096, max_num_seqs=8, max_num_batched_tokens=64)
    eager = LLM(str(tiny_llama_dir), enforce_eager=True, **common)
    graphed = LLM(str(tiny_llama_dir), mixed_graphs=True, async_scheduling=True, **common)
    refs, params = generate(eager, 13)
    outs, _ = generate(graphed, 13)
    for ref, out, p in zip(refs, outs, params):
        assert_close_greedy(ref, out, f"request {out.request_id}", max_tokens=p.max_tokens)
    graphs = graphed.engine.executor.graphs
    assert graphs.mixed_sizes == [16, 24, 32, 48, 64] and graphs.num_mixed_replays > 0 and graphs.num_replays > 0
