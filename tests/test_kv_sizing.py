"""Sizing the KV cache after the weights load (a profiling forward, vLLM's way) and the host
store from host RAM: the arithmetic, the whole build path on a CPU with a fake memory probe,
and the real path on a GPU."""
from __future__ import annotations

import pytest
import torch

from nanoserve import LLM, SamplingParams, builder
from nanoserve.builder import host_kv_blocks, kv_block_bytes
from nanoserve.config import EngineArgs
from nanoserve.kv_sizing import (
    HOST_KV_RAM_FRACTION,
    MemorySnapshot,
    check_host_kv_fits,
    host_kv_tokens_default,
    kv_budget_bytes,
    profile_batch,
)
from nanoserve.model.loader import load_config
from nanoserve.sampling import MAX_LOGPROBS

GiB = 2**30


def test_budget_is_utilization_less_the_peak_and_other_users():
    snap = MemorySnapshot(total=80 * GiB, free=50 * GiB, torch_reserved=28 * GiB, torch_peak=20 * GiB)
    # 2 GiB used outside this process's allocator (context, other processes)
    assert kv_budget_bytes(snap, 0.9) == int(72 * GiB) - 20 * GiB - 2 * GiB
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_budget_bytes(snap, 1.5)


def test_profile_batch_is_the_largest_step():
    batch, blocks = profile_batch(2048, 128, 16, vocab_size=100)
    assert sum(c.num_tokens for c in batch.chunks) == 2048 and len(batch.chunks) == 128
    assert all(c.samples and c.start == 0 for c in batch.chunks)
    used = [b for c in batch.chunks for b in c.block_table]
    assert sorted(used) == list(range(blocks))  # every block once
    assert all(t < 100 for c in batch.chunks for t in c.request.token_ids)
    batch, _ = profile_batch(10, 128, 16, vocab_size=100)
    assert len(batch.chunks) == 10  # never an empty sequence


def test_the_profile_samples_by_the_widest_path(tiny_llama_dir, monkeypatch):
    """Every profiled row draws through the penalties and top-p and reports the most logprobs, so
    the sampler's fp32 copies and temporaries are in the peak the KV cache is sized beside."""
    import nanoserve.model.sampler as sampling

    snap = MemorySnapshot(total=GiB, free=GiB // 2, torch_reserved=GiB // 4, torch_peak=GiB // 8)
    monkeypatch.setattr(builder, "memory_probe", lambda device: FakeProbe(snap))
    filtered, real_filter = [], sampling.apply_top_k_top_p
    monkeypatch.setattr(sampling, "apply_top_k_top_p", lambda logits, *a: filtered.append(logits.shape) or
                        real_filter(logits, *a))
    LLM(str(tiny_llama_dir), device="cpu", dtype="float32", max_num_batched_tokens=64, max_num_seqs=4)
    assert filtered == [(4, load_config(tiny_llama_dir).vocab_size)]  # the profile's 4 rows, the whole vocabulary
    batch, _ = profile_batch(64, 4, 16, vocab_size=100)
    assert all(c.request.params.logprobs == MAX_LOGPROBS for c in batch.chunks)


class FakeProbe:
    """A device whose memory reads back as set, on a CPU: the build path runs for real.
    `cached`: bytes the allocator holds unused (the profiling forward's activations), free
    again once released."""

    def __init__(self, snapshot: MemorySnapshot, cached: int = 0):
        self.snap, self.cached, self.calls = snapshot, cached, []

    def reset_peak(self) -> None:
        self.calls.append("reset")

    def snapshot(self) -> MemorySnapshot:
        self.calls.append("snapshot")
        return self.snap

    def free_cache(self) -> None:
        from dataclasses import replace

        self.snap, self.cached = replace(self.snap, free=self.snap.free + self.cached), 0

    def release_cached(self) -> None:
        self.calls.append("release")
        self.free_cache()


def test_build_sizes_the_cache_from_the_profile(tiny_llama_dir, monkeypatch):
    snap = MemorySnapshot(total=GiB, free=GiB // 2, torch_reserved=GiB // 4, torch_peak=GiB // 8)
    probe = FakeProbe(snap)
    seen_batches = []
    real_profile = builder.profile_batch

    def recording_profile(*args, **kwargs):
        batch, blocks = real_profile(*args, **kwargs)
        seen_batches.append((batch, blocks))
        return batch, blocks

    monkeypatch.setattr(builder, "memory_probe", lambda device: probe)
    monkeypatch.setattr(builder, "profile_batch", recording_profile)
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", max_num_batched_tokens=64, max_num_seqs=4,
              gpu_memory_utilization=0.5)
    args = EngineArgs(max_num_batched_tokens=64, max_num_seqs=4)
    cfg = load_config(tiny_llama_dir)
    block_bytes = kv_block_bytes(args, cfg, torch.float32)
    (batch, profile_blocks), = seen_batches
    assert sum(c.num_tokens for c in batch.chunks) == 64 and len(batch.chunks) == 4
    expected = (kv_budget_bytes(snap, 0.5) + profile_blocks * block_bytes) // block_bytes
    assert llm.engine.stats().kv_blocks_total == expected
    assert probe.calls == ["reset", "snapshot", "release"]  # the peak spans the profiling forward
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 4


def graph_taking(probe: FakeProbe, nbytes: int, monkeypatch) -> list:
    """Make recording StepGraphs in the builder take `nbytes` of the fake device's memory;
    returns the sizes each recording was asked for."""
    from dataclasses import replace

    real_graphs, recorded = builder.StepGraphs, []

    def taking(*args, **kwargs):
        graphs = real_graphs(*args, **kwargs)
        recorded.append((tuple(graphs.buckets), tuple(graphs.mixed_sizes)))
        probe.free_cache()  # as torch.cuda.graph does before each capture
        probe.snap = replace(probe.snap, free=probe.snap.free - nbytes)
        return graphs

    monkeypatch.setattr(builder, "StepGraphs", taking)
    return recorded


def test_the_cuda_graphs_memory_comes_out_of_the_cache(tiny_llama_dir, monkeypatch):
    """The profile records the engine's graphs over its small cache and the KV cache gives up
    what that took (here the fake device loses 5 blocks' bytes and a little more). The
    profiling forward left 3 blocks' bytes cached, which recording frees: not a saving."""
    snap = MemorySnapshot(total=GiB, free=GiB // 2, torch_reserved=GiB // 4, torch_peak=GiB // 8)
    cfg = load_config(tiny_llama_dir)
    probe = FakeProbe(snap, cached=3 * kv_block_bytes(EngineArgs(), cfg, torch.float32))
    monkeypatch.setattr(builder, "memory_probe", lambda device: probe)
    args = EngineArgs(max_num_batched_tokens=64, max_num_seqs=4)
    block_bytes = kv_block_bytes(args, cfg, torch.float32)
    recorded = graph_taking(probe, 5 * block_bytes + 1, monkeypatch)
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", max_num_batched_tokens=64, max_num_seqs=4,
              gpu_memory_utilization=0.5, decode_graph_sizes=(1, 2, 4), mixed_graph_sizes=(32, 64))
    _, profile_blocks = profile_batch(64, 4, 16, cfg.vocab_size)
    without_graphs = (kv_budget_bytes(snap, 0.5) + profile_blocks * block_bytes) // block_bytes
    assert llm.engine.stats().kv_blocks_total == without_graphs - 6
    # the profile measured the very graphs the engine then recorded
    graphs = llm.engine.executor.graphs
    assert recorded == [((1, 2, 4), (32, 64))] == [(tuple(graphs.buckets), tuple(graphs.mixed_sizes))]
    assert probe.calls == ["reset", "snapshot", "release", "snapshot", "release", "snapshot", "release"]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].token_ids) == 4


@pytest.mark.parametrize("engine_args", [dict(enforce_eager=True), dict(policy="kunserve", kv_manager="arena")],
                         ids=["eager", "arena"])
def test_no_graph_no_graph_memory(tiny_llama_dir, monkeypatch, engine_args):
    """Nothing recorded, nothing measured: enforce_eager, and KunServe's arena (its runner's
    layers change, so it records no graph)."""
    snap = MemorySnapshot(total=GiB, free=GiB // 2, torch_reserved=GiB // 4, torch_peak=GiB // 8)
    probe = FakeProbe(snap)
    monkeypatch.setattr(builder, "memory_probe", lambda device: probe)
    recorded = graph_taking(probe, GiB // 8, monkeypatch)
    LLM(str(tiny_llama_dir), device="cpu", dtype="float32", max_num_batched_tokens=64, max_num_seqs=4,
        gpu_memory_utilization=0.5, decode_graph_sizes=(1, 2), **engine_args)
    assert recorded == [] and probe.calls == ["reset", "snapshot", "release"]


def test_a_named_size_skips_the_profile(tiny_llama_dir, monkeypatch):
    monkeypatch.setattr(builder, "memory_probe", lambda device: pytest.fail("profiled although a size was named"))
    llm = LLM(str(tiny_llama_dir), device="cpu", kv_cache_tokens=256)
    assert llm.engine.stats().kv_blocks_total == 16


def test_too_little_memory_is_a_clear_error(tiny_llama_dir, monkeypatch):
    snap = MemorySnapshot(total=GiB, free=0, torch_reserved=0, torch_peak=GiB)  # the weights fill it
    monkeypatch.setattr(builder, "memory_probe", lambda device: FakeProbe(snap))
    with pytest.raises(ValueError, match="holds no block"):
        LLM(str(tiny_llama_dir), device="cpu")


def test_host_store_defaults_to_the_device_tokens_capped_by_ram():
    assert host_kv_tokens_default(1000, 100, host_ram_bytes=10**9) == 1000
    # an 80 GB GPU's cache on a 128 GiB host: a quarter of the RAM, not the cache's size
    tokens = host_kv_tokens_default(2_000_000, 36864, host_ram_bytes=128 * GiB)
    assert tokens * 36864 <= HOST_KV_RAM_FRACTION * 128 * GiB < (tokens + 1) * 36864
    with pytest.raises(ValueError, match="--host-kv-gb"):
        check_host_kv_fits(64 * GiB, available_bytes=32 * GiB)


def test_host_store_in_bytes_or_tokens(tiny_llama_dir):
    cfg = load_config(tiny_llama_dir)
    token_bytes = kv_block_bytes(EngineArgs(), cfg, torch.float32) // 16
    assert host_kv_blocks(EngineArgs(host_kv_bytes=64 * token_bytes), cfg, torch.float32, 1000, "swap") == 4
    assert host_kv_blocks(EngineArgs(host_kv_tokens=32, host_kv_bytes=GiB), cfg, torch.float32, 1000, "swap") == 2
    with pytest.raises(ValueError, match="host KV store needs"):
        host_kv_blocks(EngineArgs(host_kv_bytes=1 << 50), cfg, torch.float32, 1000, "swap")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_cache_fits_under_the_utilization(tiny_llama_dir):
    free_before, total = torch.cuda.mem_get_info()
    llm = LLM(str(tiny_llama_dir), device="cuda", gpu_memory_utilization=0.3)
    free_after, _ = torch.cuda.mem_get_info()
    cfg = load_config(tiny_llama_dir)
    kv_bytes = llm.engine.stats().kv_blocks_total * kv_block_bytes(EngineArgs(), cfg, torch.bfloat16)
    assert kv_bytes > 0.2 * total  # the weights are tiny: nearly all of the 30% is KV
    assert free_before - free_after <= 0.3 * total + (1 << 28)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 4


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_graphs_fit_under_the_utilization_too(tiny_llama_dir):
    """Mixed-step graphs up to a large token budget hold a step's activations in their own pool:
    the KV cache gives up what they take (fewer blocks than an eager engine's, same profile), so
    the engine, graphs and all, stays within its share of the device."""
    import gc

    sizes = dict(gpu_memory_utilization=0.3, max_num_batched_tokens=16384, max_num_seqs=256)
    eager = LLM(str(tiny_llama_dir), device="cuda", enforce_eager=True, **sizes)
    eager_blocks = eager.engine.stats().kv_blocks_total
    del eager
    gc.collect()
    torch.cuda.empty_cache()
    free_before, total = torch.cuda.mem_get_info()
    llm = LLM(str(tiny_llama_dir), device="cuda", mixed_graphs=True, **sizes)
    free_after, _ = torch.cuda.mem_get_info()
    assert llm.engine.executor.graphs.mixed_sizes[-1] == 16384
    # the cache gave up the graphs' pool (a step's activations at 16,384 tokens: tens of MiB)
    block_bytes = kv_block_bytes(EngineArgs(), load_config(tiny_llama_dir), torch.bfloat16)
    assert (eager_blocks - llm.engine.stats().kv_blocks_total) * block_bytes > 4 << 20
    assert free_before - free_after <= 0.3 * total + (1 << 27)
    out = llm.generate([[1, 2, 3]] * 3, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert all(len(o.token_ids) == 4 for o in out)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two NVIDIA GPUs")
def test_a_second_gpu_serves(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cuda:1", kv_cache_tokens=256)
    ref = LLM(str(tiny_llama_dir), device="cuda:0", kv_cache_tokens=256)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert (llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].token_ids
            == ref.generate([[1, 2, 3]], params, use_tqdm=False)[0].token_ids)


def test_engines_sharing_a_gpu_each_get_a_fixed_share(tiny_llama_dir, monkeypatch):
    from types import SimpleNamespace

    from nanoserve.builder import GPU_ACTIVATION_RESERVE, checkpoint_bytes, shared_device_args

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * GiB))
    args = EngineArgs(model=str(tiny_llama_dir), device="cuda:0", dtype="bfloat16", gpu_memory_utilization=0.9)
    shared = shared_device_args(args, 2)
    weights = checkpoint_bytes(tiny_llama_dir, torch.bfloat16)
    assert 0 < weights < 1 << 20
    assert shared.kv_cache_bytes == int(80 * GiB * 0.9 / 2) - weights - GPU_ACTIVATION_RESERVE
    assert shared_device_args(args, 1) is args  # alone on its GPU: the profile sizes it
    assert shared_device_args(EngineArgs(model=str(tiny_llama_dir), device="cpu"), 2).kv_cache_bytes is None
    named = EngineArgs(model=str(tiny_llama_dir), device="cuda:0", kv_cache_tokens=64)
    assert shared_device_args(named, 2) is named
