"""The copy stream on a real GPU (memory/host.py): copies issued `non_blocking` on a dedicated
stream from and to pinned host memory, one event per group, and a compute stream that waits only
for what it reads. Skipped without CUDA; the same bookkeeping runs on the CPU in every other
test."""
from __future__ import annotations

import random

import pytest
import torch
from conftest import build_tiny_model
from test_invariance import assert_close_greedy

from nanoserve import LLM, SamplingParams
from nanoserve.memory.copies import KVCopy
from nanoserve.memory.host import HostKVStore

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

B, LAYERS, HEADS, DIM, BLOCKS = 16, 4, 8, 128, 512


def caches(device="cuda"):
    g = torch.Generator(device=device).manual_seed(0)
    return [(torch.randn(BLOCKS, B, HEADS, DIM, device=device, dtype=torch.bfloat16, generator=g),
             torch.randn(BLOCKS, B, HEADS, DIM, device=device, dtype=torch.bfloat16, generator=g))
            for _ in range(LAYERS)]


def slots(blocks):
    return tuple(b * B + i for b in blocks for i in range(B))


def test_host_store_is_pinned_and_copies_round_trip_bit_identical():
    store = HostKVStore(256, B, LAYERS, HEADS, DIM, torch.bfloat16)
    assert store.k.is_pinned() and store.v.is_pinned()
    kv = caches()
    blocks = random.Random(0).sample(range(BLOCKS), 200)  # scattered device blocks
    host = store.allocate("r", 200)
    save = KVCopy("save", slots(blocks), slots(host))
    expected = [(k[blocks].clone(), v[blocks].clone()) for k, v in kv]
    store.execute([save], kv)
    assert store.inflight.pending() == [save]
    store.synchronize()
    assert store.inflight.poll() == [save]
    for k, v in kv:  # the device copy is gone
        k.fill_(float("nan")), v.fill_(float("nan"))
    targets = random.Random(1).sample(range(BLOCKS), 200)
    load = KVCopy("load", slots(host), slots(targets), reader="r")
    store.execute([load], kv)
    store.wait_for({"r"})  # the compute stream now reads after the load
    for (k, v), (ek, ev) in zip(kv, expected):
        assert torch.equal(k[targets], ek) and torch.equal(v[targets], ev)


def test_a_save_runs_under_compute_and_retire_orders_a_later_overwrite_after_it():
    store = HostKVStore(BLOCKS, B, LAYERS, HEADS, DIM, torch.bfloat16)
    kv = caches()
    host = store.allocate("r", BLOCKS)
    save = KVCopy("save", slots(range(BLOCKS)), slots(host))
    expected = [k.clone() for k, _ in kv]
    store.execute([save], kv)  # returns at once: the host thread is not blocked
    # Another rank's manager saw it land: this rank's compute stream must wait before reusing.
    store.retire([save.ticket])
    for k, v in kv:
        k.zero_(), v.zero_()  # on the compute stream, ordered after the save
    torch.cuda.synchronize()
    for layer, k in enumerate(expected):
        assert torch.equal(store.k[layer].view(BLOCKS, B, HEADS, DIM).cuda(), k)


def test_a_prefetch_for_another_request_is_not_waited_for():
    store = HostKVStore(64, B, LAYERS, HEADS, DIM, torch.bfloat16)
    kv = caches()
    host = store.allocate("later", 64)
    store.execute([KVCopy("load", slots(host), slots(range(64)), reader="later")], kv)
    assert store.inflight.handles(lambda c: c.needed_by({"now"})) == []
    assert len(store.inflight.handles(lambda c: c.needed_by({"later"}))) == 1
    store.synchronize()


def test_layer_by_layer_a_forward_reads_each_layer_once_its_part_has_landed():
    """HostKVStore(layerwise=True): one event per layer; wait_for waits for layer 0's part only,
    and each wait_layer(l) orders the compute stream after layer l's part of the load."""
    store = HostKVStore(256, B, LAYERS, HEADS, DIM, torch.bfloat16, layerwise=True)
    kv = caches()
    blocks = random.Random(2).sample(range(BLOCKS), 200)
    host = store.allocate("r", 200)
    expected = [(k[blocks].clone(), v[blocks].clone()) for k, v in kv]
    store.execute_step([[KVCopy("save", slots(blocks), slots(host))]], kv)
    store.synchronize()
    assert len(store.inflight.poll()) == 1
    for k, v in kv:
        k.fill_(float("nan")), v.fill_(float("nan"))
    targets = random.Random(3).sample(range(BLOCKS), 200)
    store.execute_step([[KVCopy("load", slots(host), slots(targets), reader="r")]], kv)
    store.wait_for({"r"})
    assert store.has_layer_waits  # layers 1.. are still to be waited for, as the forward reaches them
    for layer, ((k, v), (ek, ev)) in enumerate(zip(kv, expected)):
        store.wait_layer(layer)
        assert torch.equal(k[targets], ek) and torch.equal(v[targets], ev)  # read on the compute stream
    assert not store.has_layer_waits


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama-cuda-copies")
    build_tiny_model("llama", directory)
    return str(directory)


@pytest.mark.parametrize("kv_manager, options", [("swap", None), ("checkpoint", {"threshold": 0.25})])
@pytest.mark.parametrize("layerwise", [False, True])
def test_greedy_output_survives_overlapped_copies_on_the_gpu(llama_dir, kv_manager, options, layerwise):
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 512) for _ in range(n)] for n in (5, 17, 9, 13, 7, 19, 11, 6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    priority = ["offline" if i % 2 else "online" for i in range(len(prompts))]
    reference = LLM(llama_dir, device="cuda", dtype="float32", kv_cache_tokens=4096, block_size=4).generate(
        prompts, params, use_tqdm=False, priority=priority)
    llm = LLM(llama_dir, device="cuda", dtype="float32", kv_cache_tokens=64, block_size=4, kv_manager=kv_manager,
              kv_manager_options=options, host_kv_tokens=2048, layerwise_kv_copies=layerwise)
    outputs = llm.generate(prompts, params, use_tqdm=False, priority=priority)
    for ref, out in zip(reference, outputs):
        assert_close_greedy(ref, out, f"{kv_manager} on cuda", max_tokens=24)
    assert llm.engine.stats().num_preemptions > 0
    assert llm.engine.stats().kv_blocks_used == 0
